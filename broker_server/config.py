"""``server.toml``: what the aggregator needs, checked completely at start.

Example: ``deploy/examples/server.toml``. Relative paths are relative to the config file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from broker_server.privacy.policy import PrivacyPolicy
from flcore.bounds import InfluencePolicy
from flcore.rounds import RoundRules
from protocol.codecs import Codec, CodecError
from protocol.config import ConfigError, broker_settings, check_tables, existing_path, read_toml, refuse_unused, table
from protocol.messages import TrainSettings
from protocol.mqtt import BrokerSettings
from protocol.prometheus import MetricsSection
from protocol.topics import check_level
from protocol.transfer import MiB, TransferLimits


@dataclass(frozen=True)
class ServerSection:
    federation: str
    state_dir: str
    model: str = "digits_cnn"
    num_classes: int = 0  # 0: len(classes) for detectors, 10 for classifiers
    classes: list[str] = field(default_factory=list)  # detectors: class names in id order, as in data.yaml
    init_weights: str | None = None  # detectors: a local Ultralytics .pt (or an earlier global_model.safetensors)
    rounds: int = 0
    eval_data: str | None = None
    seed: int = 0
    status_interval_s: float = 10.0
    onnx: bool = True  # export each new global model to state_dir/global_model.onnx (checked with onnxruntime)
    share: str = "full"  # detectors: average the full model, or only its backbone or head (the rest stays local)
    codec: str = "fp32"  # how agents encode updates (protocol.codecs), sent in the signed round task
    score_trained: int | None = None  # uploads a round whose trained model is scored on eval_data (trained
    # C-GEN; 0: none); unset: 20 for a classifier, 0 for a detector (one validation takes seconds)
    score_start: int = 100  # models agents start a round from (C-GEN) that the server evaluates a round besides the
    # published one, whose evaluation it has: a sample when more differ (swapping, FedAMP at scale); 0: that one only

    def __post_init__(self) -> None:
        from models.tasks import task_of

        if self.score_trained is None:
            try:
                detector = task_of(self.model) == "detect"
            except ValueError:  # an unknown model: refused, named, by the model's own check
                detector = False
            object.__setattr__(self, "score_trained", 0 if detector else 20)
        for key, zero in (("score_trained", "no trained C-GEN"), ("score_start", "the published model's only")):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"server.{key} must be a whole number >= 0 (0: {zero}), got {value!r}")
        try:
            Codec.parse(self.codec)
        except CodecError as exc:
            raise ValueError(f"server.codec: {exc}") from None
        if len(set(self.classes)) != len(self.classes) or not all(isinstance(c, str) and c for c in self.classes):
            raise ValueError(f"server.classes must be distinct, non-empty class names, got {self.classes}")
        if self.num_classes == 0:
            object.__setattr__(self, "num_classes", len(self.classes) or 10)
        elif self.classes and self.num_classes != len(self.classes):
            raise ValueError(f"server.num_classes = {self.num_classes} but server.classes names {len(self.classes)}; "
                             "drop num_classes (it follows classes)")  # fmt: skip


@dataclass(frozen=True)
class KeysSection:
    identity: str
    enrolled: str
    rotate_every_rounds: int = 0  # a new group key before every N-th round (0 = only on revocation)

    def __post_init__(self) -> None:
        if self.rotate_every_rounds < 0:
            raise ValueError(f"keys.rotate_every_rounds must be >= 0 (0 = off), got {self.rotate_every_rounds}")


@dataclass(frozen=True)
class LimitsSection:
    """``[limits]``: what one agent, and all of them together, may make the server hold."""

    max_transfer_mb: float = 512.0  # ceiling; an update is also refused if larger than the model's update size
    max_chunks: int = 1024
    max_partial_per_agent: int = 2
    max_pending_per_agent_mb: float = 0.0  # 0: twice the model's update size
    max_pending_mb: float = 1024.0  # across all agents
    partial_timeout_s: float = 120.0

    def to_limits(self, update_bytes: int) -> TransferLimits:
        """Limits for update transfers of ``update_bytes`` (the largest a valid update can be)."""
        per_agent = int(self.max_pending_per_agent_mb * MiB) or 2 * update_bytes
        return TransferLimits(
            max_bytes=min(int(self.max_transfer_mb * MiB), update_bytes),
            max_chunks=self.max_chunks,
            max_partial_per_sender=self.max_partial_per_agent,
            max_pending_bytes_per_sender=per_agent,
            max_pending_bytes=int(self.max_pending_mb * MiB),
            partial_timeout_s=self.partial_timeout_s,
        )


@dataclass(frozen=True)
class PoolSection:
    """``[pool]``: a shared data pool (an ``.npz`` like an agent's) that the server trains on as one more
    participant, ``server-pool``, every round (seed 002's hybrid data sharing; ``broker_server.pool.shared``)."""

    data: str = ""  # "": no pool

    @property
    def enabled(self) -> bool:
        return bool(self.data)


@dataclass(frozen=True)
class UpstreamSection:
    """``[upstream]``: this server is a region's aggregator. It runs rounds with its own agents, and takes part
    in the root's rounds as one participant, ``id``, sending its aggregate (``region.daemon``)."""

    id: str  # this region's participant id at the root: its key's name, enrolled there
    federation: str  # the root's federation
    identity: str  # this region's key file (``skyfed keys new <id>``)
    server: str  # the root server's public key
    broker: BrokerSettings | None = None  # [upstream.broker]: the root's broker; None: our own, bridged to it

    def __post_init__(self) -> None:
        check_level("upstream.id", self.id)
        check_level("upstream.federation", self.federation)


# What a server of each shape never reads: given, it would be ignored without a word, so it is refused at start.
UNUSED_BY = {
    "server": {"training.recipes": "the strategy sets them in each round task from its own options ([strategy])"},
    "region": {"server.init_weights": "a region adopts the root's model before each of its rounds"},
    "classifier": {"training.image_size": "it is a detector's input size; a classifier takes its data's samples"},
}


@dataclass(frozen=True)
class ServerConfig:
    path: Path
    server: ServerSection
    broker: BrokerSettings
    keys: KeysSection
    rounds: RoundRules = field(default_factory=RoundRules)
    training: TrainSettings = field(default_factory=TrainSettings)
    strategy: dict[str, Any] = field(default_factory=dict)  # [strategy]; {} = the default strategy
    bounds: InfluencePolicy = field(default_factory=InfluencePolicy)
    limits: LimitsSection = field(default_factory=LimitsSection)
    privacy: PrivacyPolicy = field(default_factory=PrivacyPolicy)
    pool: PoolSection = field(default_factory=PoolSection)
    upstream: UpstreamSection | None = None
    metrics: MetricsSection = field(default_factory=MetricsSection)  # a Prometheus endpoint; off by default

    @property
    def state_dir(self) -> Path:
        return (self.path.parent / self.server.state_dir).resolve()

    @property
    def identity_path(self) -> Path:
        return existing_path(self.path, "keys.identity", self.keys.identity, "server key file")

    @property
    def enrolled_dir(self) -> Path:
        return existing_path(self.path, "keys.enrolled", self.keys.enrolled, "enrolled-agents folder")

    @property
    def eval_path(self) -> Path | None:
        if self.server.eval_data is None:
            return None
        return existing_path(self.path, "server.eval_data", self.server.eval_data, "evaluation data")

    @property
    def upstream_keys(self) -> tuple[Path, Path]:
        """``[upstream]``: this region's key file and the root server's public key."""
        assert self.upstream is not None
        return (existing_path(self.path, "upstream.identity", self.upstream.identity, "this region's key file"),
                existing_path(self.path, "upstream.server", self.upstream.server, "the root server's public key"))

    @property
    def pool_path(self) -> Path | None:
        if not self.pool.enabled:
            return None
        return existing_path(self.path, "pool.data", self.pool.data, "shared data pool (.npz)")

    @property
    def init_weights_path(self) -> Path | None:
        """The detector's start weights: ``server.init_weights``, else the ``.pt`` checkpoint ``server.model``
        names (its architecture and its weights)."""
        if self.server.init_weights is None:
            from models.tasks import is_model_file

            checkpoint = is_model_file(self.server.model) and self.server.model.endswith(".pt")
            return Path(self.server.model) if checkpoint else None
        return existing_path(self.path, "server.init_weights", self.server.init_weights, "Ultralytics .pt checkpoint")


def load_server_config(path: Path) -> ServerConfig:
    """Parse and check ``server.toml``; raise ``ConfigError`` naming the key and the fix."""
    from broker_server.config_checks import model_problem, pool_problem, task_problem, upstream_problem
    from flcore.strategies import build_strategy

    data = read_toml(path)
    check_tables(path, data, {"server": ServerSection, "broker": BrokerSettings, "keys": KeysSection,
                              "rounds": RoundRules, "training": TrainSettings, "strategy": None,
                              "bounds": InfluencePolicy, "limits": LimitsSection,
                              "privacy": PrivacyPolicy, "pool": PoolSection, "upstream": None,
                              "metrics": MetricsSection})  # fmt: skip
    try:
        config = ServerConfig(
            path=path,
            server=table(path, data, "server", ServerSection),
            broker=broker_settings(path, data),
            keys=table(path, data, "keys", KeysSection),
            rounds=table(path, data, "rounds", RoundRules, required=False),
            training=table(path, data, "training", TrainSettings, required=False),
            strategy=data.get("strategy", {}),
            bounds=table(path, data, "bounds", InfluencePolicy, required=False),
            limits=table(path, data, "limits", LimitsSection, required=False),
            privacy=table(path, data, "privacy", PrivacyPolicy, required=False),
            pool=table(path, data, "pool", PoolSection, required=False),
            upstream=upstream_section(path, data),
            metrics=table(path, data, "metrics", MetricsSection, required=False),
        )
        check_level("server.federation", config.server.federation)
        config.limits.to_limits(update_bytes=MiB)
        if not isinstance(config.strategy, dict):
            raise ValueError("strategy must be a table ([strategy])")
        build_strategy(config.privacy.strategy_table(config.strategy)[0])
        config.privacy.check_compatible(config.strategy, config.bounds)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if problem := model_problem(config.server):
        raise ConfigError(f"{path}: {problem}")
    if problem := task_problem(config) or pool_problem(config) or upstream_problem(config):
        raise ConfigError(f"{path}: {problem}")
    if config.server.rounds < 0:
        raise ConfigError(f"{path}: server.rounds must be >= 0 (0 = run forever), got {config.server.rounds}")
    if problem := build_strategy(config.privacy.strategy_table(config.strategy)[0]).run_problem(config.server.rounds):
        raise ConfigError(f"{path}: server.rounds = {config.server.rounds}: {problem}")
    try:
        for shape, context in server_shapes(config):
            refuse_unused(data, UNUSED_BY[shape], context)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    config.identity_path, config.enrolled_dir, config.eval_path, config.init_weights_path  # noqa: B018 - fail now
    return config


def server_shapes(config: ServerConfig) -> list[tuple[str, str]]:
    """The shapes of ``UNUSED_BY`` this server has, each with the words that name it in a refusal."""
    from models.tasks import task_of

    shapes = [("server", "in server.toml")]
    if config.upstream is not None:
        shapes.append(("region", "by a region's server (with [upstream])"))
    if task_of(config.server.model) == "classify":
        shapes.append(("classifier", f"with classifier server.model {config.server.model}"))
    return shapes


def upstream_section(path: Path, data: dict[str, Any]) -> UpstreamSection | None:
    """``[upstream]`` and its optional ``[upstream.broker]`` (TLS files resolved like ``[broker]``'s), or None."""
    if "upstream" not in data:
        return None
    raw = data["upstream"]
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: upstream must be a table ([upstream])")
    raw = dict(raw)
    broker = raw.pop("broker", None)
    section = table(path, {"upstream": raw}, "upstream", UpstreamSection)
    if broker is None:
        return section
    return replace(section, broker=broker_settings(path, {"upstream.broker": broker}, "upstream.broker"))


POOL = "server-pool"  # the shared pool's participant name: in a round's selected, accepted and metrics
POOL_NAME_TAKEN = f"{POOL!r} is the shared pool's name: enrol the agent under another id or remove [pool]"
