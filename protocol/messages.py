"""Versioned JSON messages: round tasks, status and metrics (docs/architecture.md, "MQTT topics").

These payloads are meant to be read by people (``mosquitto_sub -v -t 'skyfed/#'``) and by dashboards,
so they are plain JSON with a ``schema`` field such as ``"skyfed.agent-status/1"``. A reader accepts
its own major version and ignores fields it does not know, so a newer sender can add fields without
breaking older readers. Model bytes never travel here: they go through ``protocol.transfer``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, TypeVar

from common.untrusted_json import UntrustedJsonError, parse_untrusted_json
from protocol.codecs import Codec
from protocol.scores import MODEL_KINDS, round_headline
from protocol.typed import SchemaError, build

MAX_JSON_BYTES = 256 * 1024
OPTIMIZERS = ("sgd", "adamw")  # TrainSettings.optimizer (models.training.train_sgd)

M = TypeVar("M", bound="Message")


class MessageError(ValueError):
    """A JSON message that is not valid for its schema; ``str()`` says why."""


@dataclass(frozen=True)
class Message:
    """Base of every JSON message: ``to_json``/``from_json`` with schema and type checks.

    Nested messages (no ``SCHEMA`` of their own) are parsed from their JSON objects.
    """

    SCHEMA: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        if self.SCHEMA:
            body = {"schema": self.SCHEMA, **body}
        return body

    def to_json(self) -> bytes:
        """Compact JSON; a non-finite float anywhere becomes ``null``, so encoding never raises on one."""
        return json.dumps(finite_or_null(self.to_dict()), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_dict(cls: type[M], data: Any) -> M:
        if not isinstance(data, dict):
            raise MessageError(f"{cls.__name__} must be a JSON object")
        if cls.SCHEMA:
            schema = data.get("schema")
            expected_name, expected_major = cls.SCHEMA.rsplit("/", 1)
            if not isinstance(schema, str) or schema.rsplit("/", 1)[0] != expected_name:
                raise MessageError(f"expected schema {cls.SCHEMA!r}, got {schema!r}")
            if schema.rsplit("/", 1)[1].split(".")[0] != expected_major:
                raise MessageError(f"unsupported version {schema!r}; this reader speaks {cls.SCHEMA!r}")
        try:
            return build(cls, data, where=cls.__name__, strict=False)
        except SchemaError as exc:
            raise MessageError(str(exc)) from None

    @classmethod
    def from_json(cls: type[M], payload: bytes | str) -> M:
        try:
            data = parse_untrusted_json(payload, max_bytes=MAX_JSON_BYTES)
        except UntrustedJsonError as exc:
            raise MessageError(str(exc)) from None
        return cls.from_dict(data)

    @classmethod
    def from_signed_json(cls: type[M], payload: bytes | str) -> M:
        """The body of a signed document (``security.signing``), NOT verified: for readers that hold no
        keys, such as the monitor. Whoever acts on it verifies the signature first."""
        try:
            data = parse_untrusted_json(payload, max_bytes=MAX_JSON_BYTES)
        except UntrustedJsonError as exc:
            raise MessageError(str(exc)) from None
        return cls.from_dict(data.get("body") if isinstance(data, dict) else None)


HEADLINE = ("accuracy", "map50")  # the evaluation field rounds are compared by: classifiers, then detectors


def headline(evaluation: dict[str, float]) -> float | None:
    """An evaluation's main score: accuracy for classifiers, mAP@.5 for detectors (None without one)."""
    return next((evaluation[k] for k in HEADLINE if evaluation.get(k) is not None), None)


def finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinity (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


@dataclass(frozen=True)
class RecipeRecord:
    """One client-side training recipe a strategy asks for (``participant.recipes``, docs/architecture.md "Recipes"):
    its registered ``name``, the ``version`` of its options and the ``options``. It travels inside the signed round
    task; the server validates the options with the recipe's own options class before it signs, and the
    participant again before it trains, declining with a reason that names a recipe it lacks."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    version: int = 1


@dataclass(frozen=True)
class TrainSettings(Message):
    """Local training settings the server sends with each round (agents need no copy of them). What a strategy
    adds to plain local training (FedProx's proximal pull, partial work, FedAMN's meta-network, Ditto's personal
    model) is in ``recipes``, never in fields of its own."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    image_size: int = 640  # detectors: the square input size in pixels (a multiple of 32); classifiers ignore it
    keep_momentum: bool = False  # agents carry their SGD momentum across rounds (participant.momentum), not zeroed
    optimizer: str = "sgd"  # classifiers' local optimizer: sgd (with momentum) or adamw; a task without it: sgd
    recipes: tuple[RecipeRecord, ...] = ()  # set by the strategy, in the order they apply; not by [training]

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"training.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for key, value in (("lr", self.lr), ("momentum", self.momentum)):  # what torch.optim.SGD refused itself
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"training.{key} must be a finite number >= 0, got {value!r}")
        if self.optimizer != "sgd" and self.keep_momentum:
            raise ValueError("training.keep_momentum carries SGD's momentum across rounds: it needs training.optimizer "
                             f"= \"sgd\", got {self.optimizer!r}")  # fmt: skip
        if self.image_size < 32 or self.image_size % 32:
            raise ValueError(f"training.image_size must be a multiple of 32 (YOLO's stride), got {self.image_size}")
        if len({r.name for r in self.recipes}) != len(self.recipes):
            raise ValueError(f"recipes must name each recipe once, got {[r.name for r in self.recipes]}")


@dataclass(frozen=True)
class AgentTrain:
    """Training settings for one agent that differ from the round's shared ``train`` (a strategy's
    per-agent choice, e.g. less local work for a slow device)."""

    agent: str
    train: TrainSettings


@dataclass(frozen=True)
class AgentStart:
    """The model one agent starts this round from, when it is not the global model.

    ``source`` is ``local`` (the agent's own model after its last round, which it keeps on disk) or
    ``inbox`` (a model the server seals to this agent alone, e.g. its swap partner's). Either way the
    agent trains only from a model whose ``models.weights.fingerprint`` is ``sha256``; whatever the
    source, the signed task names the exact bits. ``peers_sha256`` (FedAMN) names the bundle of models its
    trainer attends over, sealed to it on its inbox (``flcore.agent_models.Peers``); "" for none.
    ``continues`` (model swapping after a ``local`` round, whose training is not uploaded): the agent trains on
    from its own newest model, if that descends from ``sha256``, and its update is still a delta over ``sha256``.
    """

    agent: str
    source: str
    sha256: str
    peers_sha256: str = ""
    continues: bool = False


@dataclass(frozen=True)
class RoundTask(Message):
    """What the server asks of the selected agents; published retained on ``round``, signed.

    ``attempt`` grows when the server re-announces the same round (deadline passed without quorum, or
    the server restarted mid-round); ``pending`` lists the selected agents whose update it still lacks,
    so an agent that already trained this round re-sends its stored update instead of training again.
    ``action`` says what the server will do with this round's updates (``average`` them into a new
    global model, ``swap`` models between agents; ``local``: agents train on and upload nothing, their
    status's ``last_completed_round`` tells the server they did); ``starts``
    names the agents that do not start from the global model, and what they start from; ``agent_train``
    the agents whose training settings differ from the shared ``train``. ``codec`` is how updates must be
    encoded (``protocol.codecs``; a task from before codecs has none: ``fp32``).
    """

    SCHEMA: ClassVar[str] = "skyfed.round/1"
    federation: str
    round: int
    attempt: int
    strategy: str
    model: str
    num_classes: int  # classifiers; detectors also name them in ``classes``
    model_version: int
    model_sha256: str
    model_chunks: int
    group_key_id: str
    selected: list[str]
    pending: list[str]
    deadline: float
    issued_at: float
    train: TrainSettings = field(default_factory=TrainSettings)
    run_id: str = ""
    expires_at: float = 0.0
    action: str = "average"
    starts: list[AgentStart] = field(default_factory=list)
    agent_train: list[AgentTrain] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)  # detectors: the federation's class names, in id order
    share: str = "full"  # detectors: what is averaged (full, backbone or head); agents keep the rest local
    codec: str = "fp32"
    revoked: list[str] = field(default_factory=list)  # agents whose enrolment was withdrawn: each one stops
    receipt: str = ""  # the server's signature of (run_id, round, model_version): agents echo it in their status
    # agents whose update of the round before this round still folds in (flcore.late): one still training that
    # round finishes and sends it instead of stopping
    late: list[str] = field(default_factory=list)
    late_rounds: int = 1  # how many rounds back an update in ``late`` may be from (asynchronous rounds: more than 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", str(Codec.parse(self.codec)))  # canonical, or CodecError (a ValueError)

    def train_of(self, agent: str) -> TrainSettings:
        """The settings ``agent`` trains with this round (the shared ``train`` unless ``agent_train`` says)."""
        return next((t.train for t in self.agent_train if t.agent == agent), self.train)

    def start_of(self, agent: str) -> AgentStart:
        """What ``agent`` starts from (the global model unless ``starts`` says otherwise)."""
        for start in self.starts:
            if start.agent == agent:
                return start
        return AgentStart(agent=agent, source="global", sha256=self.model_sha256)

    def is_newer_than(self, other: RoundTask) -> bool:
        """Ordering agents use to refuse replayed tasks: (round, attempt) within one server run, then the
        signed ``issued_at`` (a task re-issued within an attempt, to name a revoked agent, say), and
        ``issued_at`` across runs (a server whose state was reset starts a new ``run_id``)."""
        if self.run_id == other.run_id:
            return (self.round, self.attempt, self.issued_at) > (other.round, other.attempt, other.issued_at)
        return self.issued_at > other.issued_at

    def expired(self, now: float) -> bool:
        return self.expires_at > 0 and now > self.expires_at


@dataclass(frozen=True)
class Gate(Message):
    """Whether an agent may train now, and if not, why (battery, charging, armed, temperature)."""

    ok: bool = True
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class AgentStatus(Message):
    """Retained on ``agent/<id>/status``; the agent's LWT publishes ``state="offline"`` here."""

    SCHEMA: ClassVar[str] = "skyfed.agent-status/1"
    agent: str
    state: str
    round: int
    samples: int
    version: int
    updated_at: float
    gate: Gate = field(default_factory=Gate)
    group_key_id: str = ""
    last_completed_round: int = 0
    detail: str = ""
    errors: int = 0
    start: str = ""  # what this round's training starts from: global, local or inbox
    privacy: dict[str, float] = field(default_factory=dict)  # local DP-SGD: this agent's own epsilon, delta, ...
    run_id: str = ""  # the server run of the task it holds (``round``): a server behind it catches up
    task_version: int = 0  # that task's ``model_version``
    receipt: str = ""  # that task's ``receipt``: proof that the server issued it (broker_server.rounds.catch_up)
    session: float = 0.0  # when this connection's last will was made (broker_server.agents.registry: will freshness)
    clock_offset_s: float = 0.0  # this device's clock minus the server's, as measured on signed task times

    @classmethod
    def offline(cls, agent: str, session: float | None = None) -> AgentStatus:
        """The LWT payload: what subscribers see after the agent vanished; made at ``session`` (default now)."""
        made = time.time() if session is None else session
        return cls(agent=agent, state="offline", round=0, samples=0, version=0, updated_at=made, session=made)


@dataclass(frozen=True)
class ServerStatus(Message):
    """Retained on ``server/status``; the server's LWT publishes ``state="offline"`` here."""

    SCHEMA: ClassVar[str] = "skyfed.server-status/1"
    state: str
    federation: str
    round: int
    phase: str
    strategy: str
    model_version: int
    agents_online: int
    updated_at: float
    detail: str = ""
    errors: int = 0
    action: str = ""  # what the current round's updates are for: average, swap or local
    best: dict = field(default_factory=dict)  # the elected best model: round, version, metric, value
    privacy: dict = field(default_factory=dict)  # differential privacy: epsilon, delta, … spent so far (worst agent)
    eval: dict = field(default_factory=dict)  # the evaluation of the global model in force (accuracy, or map50, …)
    buffer: dict = field(default_factory=dict)  # asynchronous rounds: the open buffer's size, filled, in_flight

    @classmethod
    def offline(cls, federation: str) -> ServerStatus:
        """The LWT payload: what subscribers see after the server vanished."""
        return cls(
            state="offline",
            federation=federation,
            round=0,
            phase="offline",
            strategy="",
            model_version=0,
            agents_online=0,
            updated_at=time.time(),
        )


@dataclass(frozen=True)
class Rejection(Message):
    agent: str
    reason: str


@dataclass(frozen=True)
class RoundMetrics(Message):
    """One per finished round on ``server/metrics`` (not retained) and in ``metrics.jsonl``.

    ``outcome`` is ``committed`` (a new model version) or ``rolled-back`` (the aggregate failed a check:
    ``reason`` says which, ``offenders`` names the agents whose contributions dominated it, and the
    previous model stays). ``aggregation`` says how influence was bounded (clip bound, clipped and
    weight-capped agents) plus what the strategy reports (e.g. the agents multi-Krum kept).
    """

    SCHEMA: ClassVar[str] = "skyfed.metrics/1"
    round: int
    strategy: str
    participants: list[str]
    accepted: list[str]
    rejected: list[Rejection]
    duration_s: float
    aggregate_s: float
    bytes_up: int
    bytes_down: int
    eval: dict
    model_version: int
    finished_at: float
    outcome: str = "committed"
    reason: str = ""
    offenders: list[str] = field(default_factory=list)
    aggregation: dict = field(default_factory=dict)
    missed: list[str] = field(default_factory=list)  # selected agents replaced after a deadline, or revoked
    action: str = "average"  # average (a new global model), swap or local (agents keep their own models)
    privacy: dict = field(default_factory=dict)  # differential privacy: epsilon, delta, … spent so far (worst agent)
    personal: dict = field(default_factory=dict)  # C-SPE and C-GEN of the models agents trained from (personal.py)
    models: str = "global"  # what agents keep: the global model, or one per group or agent (Strategy.models)
    wasted: dict = field(default_factory=dict)  # trained updates refused for their timing, by kind (late, stale, …)
    buffer: dict = field(default_factory=dict)  # an asynchronous round: its buffer (size, updates, staleness)
    # The scores the round is judged by, lead first (protocol.scores). Always derived from the fields above,
    # never taken from a sender, so no surface can show a headline the numbers do not support.
    headline: list[dict] = field(default_factory=list)
    run_id: str = ""  # the server run the round belongs to: a new run (a state folder started over) counts from 1

    def __post_init__(self) -> None:
        if self.models not in MODEL_KINDS:
            raise ValueError(f"models must be one of {', '.join(MODEL_KINDS)}, got {self.models!r}")
        object.__setattr__(self, "headline", round_headline(self.models, self.eval, self.personal))
