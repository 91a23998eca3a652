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
from flcore.strategies.base import Strategy
from protocol.broker_settings import BrokerSettings
from protocol.codecs import Codec, CodecError
from protocol.config import ConfigError, broker_settings, check_tables, existing_path, read_toml, refuse_unused, table
from protocol.messages import TrainSettings
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
        return existing_path(self.path, "keys.identity", self.keys.identity, "server key file",
                             "skyfed provision puts it in DIR/server/; skyfed keys new makes one")

    @property
    def enrolled_dir(self) -> Path:
        return existing_path(self.path, "keys.enrolled", self.keys.enrolled, "enrolled-agents folder",
                             "skyfed provision puts it in DIR/server/enrolled/; skyfed keys enroll adds to it")

    @property
    def eval_path(self) -> Path | None:
        if self.server.eval_data is None:
            return None
        return existing_path(self.path, "server.eval_data", self.server.eval_data, "evaluation data",
                             "a classifier's .npz with x and y, a detector's YOLO data.yaml; skyfed data digits "
                             "AGENT... --out DIR writes example ones, this one in DIR/server/")

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
        return existing_path(self.path, "pool.data", self.pool.data, "shared data pool (.npz)",
                             "an .npz with x and y; skyfed data digits AGENT... --out DIR writes example ones")

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
    if problem := task_problem(config) or pool_problem(config) or upstream_problem(config) or async_problem(config):
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


def async_problem(config: ServerConfig) -> str:
    """Why ``rounds.mode = "async"`` does not fit the rest of the configuration, or ``""``."""
    from flcore.strategies import STRATEGIES, build_strategy

    if not config.rounds.is_async:
        return ""

    def own_models(kind: object) -> bool:  # kept per agent or group, swapped, or a personal part left on the agent
        return bool(kind.keeps_models or kind.swaps or kind.personal_part)  # type: ignore[attr-defined]

    built = build_strategy(config.privacy.strategy_table(config.strategy)[0])
    why = (
        f"strategy {built.name!r} gives agents models of their own, and a buffer folds updates into one global model "
        f"(choose {', '.join(STRATEGIES.where(lambda kind: not own_models(kind)))})" if own_models(built) else
        "strategy.threshold: a buffer closes at rounds.buffer updates (set that instead)" if built.threshold else
        "[upstream]: a region's rounds follow its root's (asynchronous regions are not built)"
        if config.upstream is not None else
        "[pool]: the shared pool trains once per synchronous round (not built for buffers)" if config.pool.enabled else
        f'[privacy] with rounds.staleness = "{config.rounds.staleness}": the noise covers one clipped update per '
        'agent at full weight; set rounds.staleness = "constant"'
        if config.privacy.enabled and config.rounds.staleness_fn.kind != "constant" else ""
    )  # fmt: skip
    return f'rounds.mode = "async" with {why}' if why else ""


def upstream_problem(config: ServerConfig) -> str:
    """Why ``[upstream]`` does not fit the rest of the configuration, or ``""``."""
    from flcore.strategies import build_strategy
    from flcore.strategies.capabilities import averaging_choices

    upstream = config.upstream
    if upstream is None:
        return ""
    if config.server.rounds != 0:
        return (f"server.rounds = {config.server.rounds} with [upstream]: a region runs one round for each round "
                "of the root, for as long as the root runs; set server.rounds = 0")  # fmt: skip
    if upstream.broker is None and upstream.federation == config.server.federation:
        return (f"upstream.federation and server.federation are both {upstream.federation!r}: over a bridged broker "
                "the region's agents and the root's participants would share topics; give the region its own "
                "federation name")  # fmt: skip
    if build_strategy(config.privacy.strategy_table(config.strategy)[0]).keeps_models:
        return ("[upstream] with a strategy that gives each agent its own model: a region sends the root one "
                f"aggregate; choose an averaging strategy ({averaging_choices()})")  # fmt: skip
    config.upstream_keys  # noqa: B018 - fail now
    return ""


def pool_problem(config: ServerConfig) -> str:
    """Why ``[pool]`` does not fit the rest of the configuration, or ``""``."""
    from broker_server.pool import POOL, POOL_NAME_TAKEN
    from flcore.strategies import build_strategy
    from flcore.strategies.capabilities import averaging_choices
    from models.datasets import load_dataset
    from models.tasks import task_of
    from security.keys import Keyring

    if (path := config.pool_path) is None:
        return ""
    if task_of(config.server.model) != "classify":
        return (f"pool.data is a classifier .npz and server.model {config.server.model} is a detector: remove [pool] "
                "or choose a classifier model")  # fmt: skip
    strategy = build_strategy(config.privacy.strategy_table(config.strategy)[0])
    if strategy.keeps_models:
        return (f"[pool] with strategy {strategy.name}: the strategy gives every participant its own start model, "
                f"and the pool trains from the global model: choose an averaging strategy ({averaging_choices()}) or "
                "remove [pool]")  # fmt: skip
    if POOL in Keyring.load_dir(config.enrolled_dir).names():
        return f"an agent is enrolled as {POOL!r}: {POOL_NAME_TAKEN}"
    try:
        data = load_dataset(path)
    except ValueError as exc:
        return f"pool.data: {exc}"
    if not len(data):
        return f"pool.data = {config.pool.data!r} holds no samples: give it some, or remove [pool]"
    if int(data.y.max()) >= config.server.num_classes:
        return (f"pool.data holds label {int(data.y.max())}, and server.num_classes is {config.server.num_classes}: "
                "labels must be 0 .. num_classes - 1")  # fmt: skip
    return ""


def model_problem(server: ServerSection) -> str:
    """Why ``server.model`` names no model the server can build, or ``""``: a zoo name, or the operator's own
    ``package.module:function`` (imported here, from the operator's own config only; docs/own-model.md)."""
    from models.own import is_reference
    from models.tasks import CLASSIFIERS, YOLO_YAMLS, is_model_file  # the zoo's names, without importing PyTorch

    if is_model_file(server.model):  # the operator's own detector: built here once, so a bad file fails at start
        from models.yolo import model_file_problem

        return model_file_problem(server.model, "server.model", max(1, len(server.classes)))
    if is_reference(server.model):
        from models.own import check_own_model

        try:
            check_own_model(server.model, server.num_classes, "server.model")
        except ValueError as exc:
            return str(exc)
        return ""
    if server.model not in (*CLASSIFIERS, *YOLO_YAMLS):
        return (f"server.model {server.model!r} is unknown; choose one of {sorted([*CLASSIFIERS, *YOLO_YAMLS])} "
                'or your own "package.module:function" (docs/own-model.md)')
    return ""


def recipe_problem(strategy: Strategy, training: TrainSettings, trainer: str) -> str:
    """Why a ``trainer``'s participants could not follow the recipes ``strategy`` asks for, or ``""``: found at start
    instead of every participant declining every round."""
    from participant.recipes import refusal

    plan = strategy.configure_train(training, 1, {})
    for settings in (plan.shared, *plan.agents.values()):
        for record in settings.recipes:
            if why := refusal(record, trainer):
                return f"strategy {strategy.name}: {why}"
    return ""


def task_problem(config: ServerConfig) -> str:
    """Why the model's task (classify or detect) does not fit the rest of the configuration, or ``""``."""
    from flcore.strategies import build_strategy
    from flcore.strategies.capabilities import task_refusal
    from models.tasks import PARTS, task_of

    server = config.server
    strategy = build_strategy(config.privacy.strategy_table(config.strategy)[0])
    if refusal := task_refusal(type(strategy), task_of(server.model)):
        return refusal
    if task_of(server.model) == "classify":
        if server.classes or server.init_weights or server.share != "full":
            return f"server.classes, init_weights and share are for detector models; {server.model} is a classifier"
        return ""
    if server.share not in PARTS:
        return f"server.share must be one of {', '.join(PARTS)}, got {server.share!r}"
    if server.share != "full" and strategy.keeps_models:
        return (
            "server.share = backbone/head keeps part of each model on its agent; swapping strategies move whole models"
        )
    if not server.classes:
        return (f'server.classes must name the classes of detector {server.model}, in id order, e.g. classes = '
                '["car", "truck", "person"] (the names in your data.yaml)')  # fmt: skip
    if config.training.optimizer != "sgd":
        return (f"training.optimizer = {config.training.optimizer!r} is for classifier models; the detector trainer "
                f"runs Ultralytics' SGD: remove training.optimizer or choose a classifier model")  # fmt: skip
    if problem := recipe_problem(strategy, config.training, "detector"):
        return f"{problem}: choose another strategy or a classifier model"
    if config.eval_path is not None and config.eval_path.suffix not in (".yaml", ".yml"):
        return f"server.eval_data must be a YOLO data.yaml for detector {server.model}, got {config.eval_path.name}"
    if config.eval_path is not None:
        from models.yolo_dataset import DatasetError, load_data_yaml

        try:
            names = load_data_yaml(config.eval_path).names
        except DatasetError as exc:
            return f"server.eval_data: {exc}"
        if list(names) != server.classes:
            return f"server.eval_data names classes {list(names)} but server.classes is {server.classes}"
    return ""
