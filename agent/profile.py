"""What the agent daemon knows about its own data and privacy budget without PyTorch.

The daemon decides whether it can take part in a round (its gate, its status) from this profile; the
training itself runs in a child process (``agent.runner``). The data file is read and checked once at
start (a bad file fails there, naming it), then dropped: the child loads it again for each round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.config import AgentConfig
from agent.trainers import classifier_data
from common.files import read_json
from models.own import is_reference, model_refusal
from models.tasks import task_of
from models.yolo_dataset import class_counts, load_data_yaml
from participant.local_dp import LocalPrivacySection
from protocol.config import ConfigError
from protocol.messages import RoundTask
from security.keys import Identity, PublicIdentity


@dataclass(frozen=True)
class DataProfile:
    kind: str  # classify | detect: the models this agent's trainer can train
    samples: int  # training examples (images for detectors)
    names: tuple[str, ...] = ()  # a detector's class names, in data.yaml's order
    model: str = ""  # the model the agent's own config names ("" = any zoo model)

    def refusal(self, task: RoundTask) -> str:
        """Why this agent cannot train ``task``'s model on its data (``""`` when it can). A task naming the
        operator's own code (``package.module:function``) is trained only if this agent's own config names
        the same: a name received over MQTT is never imported."""
        if refusal := model_refusal(task.model, self.model):
            return refusal
        if task_of(task.model) != self.kind:
            wanted = "a classifier" if self.kind == "classify" else "a detector"
            return f"wrong-task: {task.model} is not {wanted}; set training.trainer to match the federation"
        if self.kind == "detect" and list(self.names) != task.classes:
            return f"class-mismatch: data.yaml names {list(self.names)}, the federation {task.classes}"
        return ""


def data_profile(config: AgentConfig) -> DataProfile:
    """Read ``agent.data`` once: the trainer's kind, its sample count and (detectors) class names."""
    if config.training.trainer == "detector":
        data = load_data_yaml(config.data_path)
        if int(class_counts(data.train, data.num_classes).sum()) == 0:
            raise ValueError(f"{config.data_path}: the train split holds no labelled objects; nothing to learn from")
        return DataProfile("detect", len(data.train), tuple(data.names), config.own_model)
    return DataProfile("classify", len(classifier_data(config, config.data_path)), model=config.own_model)


def check_own_model(config: AgentConfig) -> None:
    """The agent's own ``package.module:build`` (``training.model``, ``federation.model``) built and run once,
    and its data checked against it: sample shape and (peer mode, which knows the classes) label range."""
    from models.own import check_own_model as check_model

    key = config.own_model_key
    shape = check_model(config.own_model, config.federation.num_classes, key)
    for data_key, path in (("agent.data", config.data_path), ("agent.test_data", config.test_data_path)):
        if path is None:
            continue
        data = classifier_data(config, path)
        if data.x.shape[1:] != shape:
            raise ValueError(f"{data_key} holds samples of shape {data.x.shape[1:]}, {key} {config.own_model} takes "
                             f"INPUT_SHAPE {shape}")  # fmt: skip
        if config.peer_mode and int(data.y.max()) >= config.federation.num_classes:
            raise ValueError(f"{data_key} holds label {int(data.y.max())}, federation.num_classes is "
                             f"{config.federation.num_classes}")  # fmt: skip


@dataclass(frozen=True)
class StartFiles:
    """What the agent daemon reads from disk at start, besides its config."""

    identity: Identity
    server: PublicIdentity
    profile: DataProfile


def read_start_files(config: AgentConfig) -> StartFiles:
    """The agent's keys and data, read and checked (by ``agent run`` and ``agent check``); an error is a
    ``ConfigError`` naming the key and the fix: a public key given as ``keys.identity``, a private one as
    ``keys.server``, another node's key, or a data file (``agent.data``, ``agent.test_data``) that cannot be read."""
    where = f"{config.path}: "
    try:
        identity = Identity.load(config.identity_path)
    except ValueError as exc:
        raise ConfigError(f"{where}keys.identity = {config.keys.identity!r}: {exc}") from None
    if identity.name != config.agent.id:
        raise ConfigError(f"{where}keys.identity holds the key of {identity.name!r}, not agent.id {config.agent.id!r}: "
                          f"give this agent's own key ({config.agent.id}.key from `skyfed keys new`)")  # fmt: skip
    try:
        server = PublicIdentity.load(config.server_key_path)
    except ValueError as exc:
        raise ConfigError(f"{where}keys.server = {config.keys.server!r}: {exc}") from None
    try:
        profile = data_profile(config)
        if is_reference(config.own_model):
            check_own_model(config)
    except (OSError, ValueError, KeyError) as exc:
        if config.agent.data_loader or is_reference(config.own_model):  # the operator's code: its key is named
            raise ConfigError(f"{where}{exc}") from None
        expected = ("a YOLO data.yaml" if config.training.trainer == "detector"
                    else "an .npz file with arrays x and y (README: Agent data format)")  # fmt: skip
        raise ConfigError(f"{where}agent.data = {config.agent.data!r}: {exc}; training.trainer = "
                          f"{config.training.trainer!r} reads {expected}") from None  # fmt: skip
    if config.test_data_path is not None:
        try:
            classifier_data(config, config.test_data_path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}agent.test_data = {config.agent.test_data!r}: {exc}; the local test split "
                              "is an .npz file with arrays x and y like agent.data") from None  # fmt: skip
    return StartFiles(identity, server, profile)


class PrivacyView:
    """The local DP-SGD budget as the training child last wrote it (``<state_dir>/privacy.json``)."""

    def __init__(self, policy: LocalPrivacySection, path: Path) -> None:
        self.policy = policy
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._record: dict = {}

    def _read(self) -> dict:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return {}
        if (stat.st_mtime_ns, stat.st_size) != self._stamp:
            self._stamp, self._record = (stat.st_mtime_ns, stat.st_size), read_json(self.path)
        return self._record

    def refusal(self) -> str:
        """Why another round like the last would pass ``target_epsilon`` (the child decides and records it)."""
        return str(self._read().get("gate", ""))

    def summary(self) -> dict[str, float]:
        record = self._read()
        return {
            "epsilon": float(record.get("epsilon", 0.0)),
            "delta": self.policy.delta,
            "target_epsilon": self.policy.target_epsilon,
            "noise_multiplier": self.policy.noise_multiplier,
            "max_grad_norm": self.policy.max_grad_norm,
            "steps": float(sum(step[2] for step in record.get("history", []))),
        }


def privacy_view(config: AgentConfig) -> PrivacyView | None:
    return PrivacyView(config.privacy, config.state_dir / "privacy.json") if config.privacy.enabled else None
