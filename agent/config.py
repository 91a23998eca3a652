"""``agent.toml``: what one edge agent needs, checked completely at start.

Example: ``deploy/examples/agent.toml``. Relative paths are relative to the config file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agent.device import check_device_spec
from agent.peer.plan import FederationSection
from agent.telemetry import GatePolicy, TelemetrySection, check_availability, check_gate_sources
from participant.local_dp import LocalPrivacySection
from protocol.broker_settings import BrokerSettings
from protocol.config import ConfigError, broker_settings, check_tables, existing_path, read_toml, refuse_unused, table
from protocol.prometheus import MetricsSection
from protocol.topics import check_level


@dataclass(frozen=True)
class AgentSection:
    id: str
    federation: str
    state_dir: str
    data: str
    test_data: str = ""  # classifier: the local test split (.npz, never trained on); "" = none
    data_loader: str = ""  # classifier: "package.module:load" reads data and test_data instead of .npz (models.own)
    seed: int = 0
    status_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.status_interval_s > 0:
            raise ValueError(f"agent.status_interval_s must be > 0 seconds (how often the agent says it is alive), "
                             f"got {self.status_interval_s}")  # fmt: skip


@dataclass(frozen=True)
class KeysSection:
    identity: str
    server: str = ""  # client mode: the server's public key
    enrolled: str = ""  # peer mode: the folder of every peer's .pub (``revoked/`` inside it), as the server's


# Keys one role never reads: given, they would be ignored without a word, so each is refused at start, naming why.
UNUSED_BY = {
    "peer": {
        "agent.status_interval_s": "a peer publishes its signed membership when it changes, not a status on a timer",
        "training.onnx": "a peer keeps no ONNX export; its model is state_dir/best_model.safetensors",
    },
    "client": {"keys.enrolled": "an edge agent trusts the server's key (keys.server); the enrolled folder is a peer's"},
}


TRAINERS = ("classifier", "detector")
WORKERS = ("adaptive", "per-round", "warm")


@dataclass(frozen=True)
class TrainingSection:
    trainer: str = "classifier"  # classifier: agent.data is an .npz; detector: a YOLO data.yaml
    model: str = ""  # client mode: the model this agent builds (zoo name or "package.module:build"); "" = zoo only
    device: str = "auto"  # auto | cpu | cuda | cuda:N (agent.device)
    amp: bool = False  # detector on CUDA: fp16 mixed precision, its loss scale kept across rounds
    threads: int = 0
    onnx: bool = True  # keep the newest global model as state_dir/global_model.onnx for `skyfed agent infer`
    worker: str = "adaptive"  # the training child's life (agent.runner): adaptive, per-round or warm
    warm_idle_s: float = 120.0  # adaptive: the child exits after this long without a job
    time_limit_s: float = 3600.0  # a training or export job running longer is killed and reported

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"training.trainer must be one of {', '.join(TRAINERS)}, got {self.trainer!r}")
        check_device_spec(self.device)
        if self.amp and (self.trainer != "detector" or self.device == "cpu"):
            raise ValueError('training.amp = true is for trainer = "detector" on a CUDA device; set amp = false')
        if self.worker not in WORKERS:
            raise ValueError(f"training.worker must be one of {', '.join(WORKERS)}, got {self.worker!r}")
        if not self.warm_idle_s > 0:
            raise ValueError(f"training.warm_idle_s must be > 0 seconds, got {self.warm_idle_s}")
        if not self.time_limit_s > 0:
            raise ValueError(f"training.time_limit_s must be > 0 seconds, got {self.time_limit_s}")
        if self.threads < 0:
            raise ValueError(f"training.threads must be >= 0 (0 = PyTorch's default), got {self.threads}")


@dataclass(frozen=True)
class AgentConfig:
    path: Path
    agent: AgentSection
    broker: BrokerSettings
    keys: KeysSection
    training: TrainingSection = field(default_factory=TrainingSection)
    privacy: LocalPrivacySection = field(default_factory=LocalPrivacySection)  # local DP-SGD; off by default
    gate: GatePolicy = field(default_factory=GatePolicy)  # when the device skips rounds (agent.telemetry)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)  # where device state comes from
    federation: FederationSection = field(default_factory=FederationSection)  # client or peer mode (agent.peer)
    metrics: MetricsSection = field(default_factory=MetricsSection)  # a Prometheus endpoint; off by default

    @property
    def peer_mode(self) -> bool:
        return self.federation.mode == "peer"

    @property
    def own_model(self) -> str:
        """The model this agent's own config names ("" = any zoo model the server's task names)."""
        return self.federation.model if self.peer_mode else self.training.model

    @property
    def own_model_key(self) -> str:
        return "federation.model" if self.peer_mode else "training.model"

    @property
    def state_dir(self) -> Path:
        return (self.path.parent / self.agent.state_dir).resolve()

    @property
    def detector_dir(self) -> Path:
        """The YOLO trainer's work dir: its Ultralytics settings, resolved data.yaml, kept state."""
        return self.state_dir / "detector"

    @property
    def data_path(self) -> Path:
        return existing_path(self.path, "agent.data", self.agent.data, "training data",
                             "a classifier's .npz with x and y, a detector's YOLO data.yaml (docs/detection.md); "
                             "skyfed data digits AGENT... --out DIR writes example ones")

    @property
    def test_data_path(self) -> Path | None:
        """The local test split, or None when ``agent.test_data`` is unset."""
        if not self.agent.test_data:
            return None
        return existing_path(self.path, "agent.test_data", self.agent.test_data, "local test split",
                             "an .npz with x and y; skyfed data digits AGENT... --out DIR writes example ones")

    @property
    def identity_path(self) -> Path:
        return existing_path(self.path, "keys.identity", self.keys.identity, "agent key file",
                             "skyfed provision puts it in DIR/agents/<id>/, a peer's in DIR/peers/<id>/; "
                             "skyfed keys new makes one")

    @property
    def server_key_path(self) -> Path:
        return existing_path(self.path, "keys.server", self.keys.server, "server public key",
                             "skyfed provision puts it in DIR/agents/<id>/; copy the server's .pub")

    @property
    def init_weights_path(self) -> Path | None:
        """Peer mode: the detector checkpoint every peer starts from, or None (the seeded model)."""
        if not self.federation.init_weights:
            return None
        return existing_path(self.path, "federation.init_weights", self.federation.init_weights, "start checkpoint")

    @property
    def enrolled_dir(self) -> Path:
        """Peer mode: the enrolled peers' public keys."""
        return existing_path(self.path, "keys.enrolled", self.keys.enrolled, "enrolled-peers folder",
                             "skyfed provision --mode peer puts it in DIR/peers/<id>/enrolled/")


def load_agent_config(path: Path) -> AgentConfig:
    """Parse and check ``agent.toml``; raise ``ConfigError`` naming the key and the fix."""
    data = read_toml(path)
    check_tables(path, data, {"agent": AgentSection, "broker": BrokerSettings, "keys": KeysSection,
                              "training": TrainingSection, "privacy": LocalPrivacySection, "gate": GatePolicy,
                              "telemetry": TelemetrySection, "federation": FederationSection,
                              "metrics": MetricsSection})  # fmt: skip
    try:
        config = AgentConfig(
            path=path,
            agent=table(path, data, "agent", AgentSection),
            broker=broker_settings(path, data),
            keys=table(path, data, "keys", KeysSection),
            training=table(path, data, "training", TrainingSection, required=False),
            privacy=table(path, data, "privacy", LocalPrivacySection, required=False),
            gate=table(path, data, "gate", GatePolicy, required=False),
            telemetry=table(path, data, "telemetry", TelemetrySection, required=False),
            federation=table(path, data, "federation", FederationSection, required=False),
            metrics=table(path, data, "metrics", MetricsSection, required=False),
        )
        check_gate_sources(config.gate, config.telemetry)
        check_availability(config.gate, config.agent.id)
        check_level("agent.id", config.agent.id)
        if config.training.trainer == "detector" and config.agent.test_data:
            raise ValueError('agent.test_data (a local test split .npz) is for training.trainer = "classifier"; '
                             "a detector's data.yaml names its own val split: remove it")  # fmt: skip
        if config.training.trainer == "detector" and config.privacy.enabled:
            raise ValueError('[privacy] (local DP-SGD) works with training.trainer = "classifier" only; remove it')
        check_level("agent.federation", config.agent.federation)
        check_own_code(config)
        if "warm_idle_s" in data.get("training", {}) and config.training.worker != "adaptive":
            raise ValueError(f'training.warm_idle_s is for training.worker = "adaptive" (how long an idle child '
                             f'stays); worker = "{config.training.worker}" never reads it: remove it')  # fmt: skip
        refuse_unused(data, UNUSED_BY[config.federation.mode], f'with federation.mode = "{config.federation.mode}"')
        check_keys(config)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    config.data_path, config.test_data_path, config.identity_path  # noqa: B018 - fail now
    config.enrolled_dir if config.peer_mode else config.server_key_path  # noqa: B018
    config.init_weights_path  # noqa: B018
    return config


def check_own_code(config: AgentConfig) -> None:
    """Where ``training.model`` and ``agent.data_loader`` may be set (their code is imported and run at start,
    by ``agent.profile.read_start_files``)."""
    from models.tasks import is_model_file, task_of

    if config.peer_mode and config.training.model:
        raise ValueError('training.model is for client mode; with federation.mode = "peer" federation.model names '
                         "the model: remove training.model")  # fmt: skip
    if config.training.model:
        try:
            kind = task_of(config.training.model)
        except ValueError as exc:
            raise ValueError(f"training.{exc}") from None
        if kind != ("detect" if config.training.trainer == "detector" else "classify"):
            raise ValueError(f"training.model {config.training.model} does not fit training.trainer = "
                             f"{config.training.trainer!r}: set the trainer for that model")  # fmt: skip
        if is_model_file(config.training.model) and not Path(config.training.model).is_file():
            raise ValueError(f"training.model = {config.training.model!r}: no such file on this device; copy the "
                             "server's model file to the same absolute path")  # fmt: skip
    if config.agent.data_loader and config.peer_mode:
        raise ValueError('agent.data_loader is for client mode; a peer (federation.mode = "peer") reads its .npz '
                         "data and test_data itself: remove it")  # fmt: skip
    if config.agent.data_loader and config.training.trainer != "classifier":
        raise ValueError('agent.data_loader is for training.trainer = "classifier" (a detector reads a YOLO '
                         "data.yaml): remove it")  # fmt: skip


def check_keys(config: AgentConfig) -> None:
    """Client mode trusts the server's key; peer mode the enrolled peers' folder, and needs a local test split
    (its validation split: BestAgg scores models on it)."""
    if config.peer_mode:
        if not config.keys.enrolled or config.keys.server:
            raise ValueError('keys.enrolled (the folder of every peer\'s .pub) is required with federation.mode = '
                             '"peer", and keys.server is not (there is no server): fix [keys]')  # fmt: skip
        check_peer_data(config)
    elif not config.keys.server:
        raise ValueError("keys.server (the server's public key) is required in client mode: set it in [keys]")


def check_peer_data(config: AgentConfig) -> None:
    """A peer scores models (each round's ``eval``, BestAgg) on its local validation split: a classifier's
    ``agent.test_data``, a detector's data.yaml val split, whose class names must be the plan's."""
    from models.tasks import task_of

    detector = task_of(config.federation.model) == "detect"
    if config.training.trainer != ("detector" if detector else "classifier"):
        raise ValueError(f"federation.model {config.federation.model} needs training.trainer = "
                         f"\"{'detector' if detector else 'classifier'}\"")  # fmt: skip
    if not detector:
        if not config.agent.test_data:
            raise ValueError('federation.mode = "peer" with a classifier needs agent.test_data (its local validation '
                             "split, which BestAgg scores models on)")  # fmt: skip
        return
    from models.yolo_dataset import DatasetError, load_data_yaml

    try:
        data = load_data_yaml(config.data_path)
    except DatasetError as exc:
        raise ValueError(f"agent.data: {exc}") from None
    if not data.val:
        raise ValueError(f"agent.data {config.data_path}: its val split holds no images; a peer scores models on it "
                         "(each round's eval, BestAgg): add a val split")  # fmt: skip
    if list(data.names) != config.federation.classes:
        raise ValueError(f"agent.data names classes {list(data.names)} but federation.classes is "
                         f"{config.federation.classes}: they must be the same, in id order")  # fmt: skip
