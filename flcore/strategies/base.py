"""The strategy interface the round engine drives.

A round is ``action`` and ``configure_train`` (what the round task asks of each agent) → ``begin`` →
(per accepted update, for streaming strategies) ``fold_plan`` → ``aggregate`` → ``plan_starts``. A
strategy that needs every update of the round (median, Krum) overrides ``aggregate`` alone: the
buffering is the update store's. ``plan_starts`` decides, after the round, what every agent starts the
next one from and whether the round's result is published as the global model: by default it is, and
everyone starts from it. Strategies that keep per-agent or per-group models (``keeps_models``: model
swapping, DemLearn) override it; the server keeps their models on disk (``flcore.agent_models``)
and seals each agent's start model to it alone.
Updates arrive validated and with their influence bounded (``flcore.bounds``): a strategy sees
``Contribution``s — a read-only float32 delta over the global model's floating tensors, the capped
sample count and the clip scale — and returns the next global vector. Every accepted update stays in
the server's on-disk update store until the round is committed, so a strategy that needs all of them
(median, Krum) reads them in column blocks at ``aggregate`` and keeps nothing per agent in RAM; a
streaming one (FedAvg) folds each update into a running sum as it arrives and only corrects at the end.
Options come from the ``[strategy]`` table (``Options`` dataclass, validated with the key named).
``on_commit`` updates what must last across rounds (server optimizer moments, for instance) once a
round's result was accepted, and ``state``/``restore`` carry it through the checkpoint.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from flcore import blas
from flcore.agent_models import Assignment, Holding, KeepWriter, Peers
from flcore.bounds import Tentative
from flcore.onepass import Fold
from models.weights import TensorSpec
from protocol.messages import RecipeRecord, TrainSettings
from protocol.typed import SchemaError, build

NamedArrays = dict[str, np.ndarray]
BLOCK_BYTES = 3 << 19  # one column block of all updates: within a core's L2 cache, so a kernel's passes stay there
BLOCK_MIN_COLUMNS = 4096  # many agents: wider than the cache, so per-block overhead stays small
KEPT_MODELS_NOT_PEERS = "it keeps every agent's model on a server and sends each agent its own start model"


@dataclass(frozen=True)
class Contribution:
    """One accepted update as a strategy sees it at the end of the round."""

    agent: str
    delta: np.ndarray  # read-only view of the stored update
    samples: float  # claimed sample count, capped by the bounds
    scale: float  # clip factor min(1, C / norm)
    norm: float
    folded: float = 0.0  # coefficient a streaming strategy already folded in (0: not folded)
    model: np.ndarray | None = None  # the agent's whole model after the round (model-keeping strategies only)


@dataclass(frozen=True)
class RoundResult:
    """The new global float vector, and what the strategy wants reported in ``metrics.aggregation``."""

    global_vector: np.ndarray
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainPlan:
    """What a round task asks of the agents: ``shared`` settings, and ``agents`` whose own differ."""

    shared: TrainSettings
    agents: dict[str, TrainSettings] = field(default_factory=dict)


@dataclass(frozen=True)
class StartPlan:
    """After a round: whether its result is ``publish``ed as the new global model, and ``starts``: what an
    agent starts its next round from (an agent absent starts from the global model; ``None``: everyone
    does). ``detail`` goes to ``metrics.aggregation``."""

    publish: bool = True
    starts: dict[str, Assignment] | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class KeptModels:
    """What ``plan_starts`` of a model-keeping strategy sees: the models agents hold after this round, read
    from and written to the server's model store."""

    round: int
    action: str
    agents: list[str]  # whose update counted this round, in the order of the contributions
    kept: dict[str, Holding]  # each of them: its model after the round
    exact: set[str]  # agents whose kept model is bit for bit the agent's own copy (it needs no download)
    current: dict[str, Assignment]  # what every agent started this round from
    spec: tuple[TensorSpec, ...]  # layout of the float vectors
    vector: Callable[[Holding], np.ndarray]  # a kept model's float vector (read-only, memory-mapped)
    # a new model to keep (a group's, say), written as it is computed (``ModelBank.new_models``); each writer's
    # pieces may be written from another thread, one at a time and in order
    writer: KeepWriter
    peers: Callable[[tuple[Holding, ...]], Peers]  # kept models as a bundle an agent attends over (FedAMN)
    rng: Callable[[], np.random.Generator]  # seeded per round: the same after a restart
    evaluate: Callable[[np.ndarray], dict[str, float]] | None = None  # a float vector on the server's eval set
    # Differential privacy: ``agent``'s kept model as it may leave the server (a Gaussian mechanism over its
    # clipped change, ``broker_server.privacy.gaussian.release``), kept as a new model; None without privacy.
    release: Callable[[str], Holding] | None = None

    def put(self, owner: str, vector: np.ndarray) -> Holding:
        """Keep ``vector`` as a new model (``writer``)."""
        return self.writer(owner).keep(vector)

    def own(self, agent: str) -> Assignment:
        """``agent`` goes on from its own kept model: no download if the server's copy is its own, bit for bit."""
        return Assignment("local" if agent in self.exact else "inbox", self.kept[agent])


@dataclass(frozen=True)
class NoOptions:
    pass


def asking(settings: TrainSettings, name: str, **options: object) -> TrainSettings:
    """``settings`` that also ask participants to follow the client recipe ``name`` with ``options``
    (``participant.recipes``; checked against the recipe's own options before the task is signed)."""
    return replace(settings, recipes=(*settings.recipes, RecipeRecord(name, dict(options))))


class Strategy(ABC):
    """Base class: override ``aggregate``; streaming strategies also ``begin`` and ``fold_plan``."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    # True when the new model is a convex combination of clipped deltas, so its change is within the clip bound.
    bounded_by_clip: ClassVar[bool] = False
    threshold: int = 0  # close the round once this many updates are in (``[strategy] threshold``; 0 = off)
    elect_best: bool = False  # at the end of the run, publish the version that evaluated best (SmartFed)
    late_weight: float = 0.0  # a late update of the round before joins the next at this weight (``flcore.late``)
    # Fold updates into a running sum as they arrive (``fold_plan``). Off under differential privacy: an
    # update is then processed at close whatever its norm, so the round's timing says nothing about it.
    fold_on_accept: bool = True
    # True when every agent's model is kept across rounds (``flcore.agent_models``): deltas are then
    # over each agent's own start model, and ``Contribution.model`` holds its model after the round.
    keeps_models: ClassVar[bool] = False
    # What agents are judged by (``protocol.scores``): the one global model, or a model per group or per agent.
    models: ClassVar[str] = "global"
    # What else a strategy can do is declared here, and every check elsewhere asks it (docs/architecture.md,
    # "Plug-ins"; the table in docs/strategies.md is generated from these, ``flcore.strategies.capabilities``).
    # Under [privacy]: True when the result is a mean of the clipped updates weighted by ``strategy.weighting``
    # in [0, 1] over the number of updates (FedAvg's kin), so weighting = "samples" needs privacy.weight_cap;
    # False: unweighted (a robust aggregate), where weight_cap means nothing. Whether privacy runs the strategy
    # at all is ``dp_sensitivity``'s answer; ``why_not_private`` says why not when it has none.
    weighted: ClassVar[bool] = False
    why_not_private: ClassVar[str] = ""
    # True when agents' models are handed to other agents (model swapping): under privacy each is released
    # noised on its own, and the average rounds, by the strategy its ``options.aggregate`` names, must be a
    # plain mean (``broker_server.privacy.policy``).
    swaps: ClassVar[bool] = False
    # Whether peers (``agent.peer``) can run it: True, or why not. A peer has the round's updates and its own
    # model, and nothing a server adds (a round task's training settings, kept models, an optimizer step).
    peers: ClassVar[bool | str] = True
    # The task kinds (``models.tasks``: classify, detect) whose trainers do what the strategy asks of agents;
    # ``why_not_tasks`` says what the others lack.
    tasks: ClassVar[frozenset[str]] = frozenset({"classify", "detect"})
    why_not_tasks: ClassVar[str] = ""
    # Whether it works with agents' local DP-SGD (``participant.local_dp``): True, or why not.
    local_dp: ClassVar[bool | str] = True
    # What of each agent's model never reaches the aggregator (FedPer's personal head), or "": the published model
    # then lacks it, so its evaluation judges neither an update (screening) nor a round (collapse).
    personal_part: ClassVar[str] = ""
    last_round: int = 0  # ``server.rounds`` (0: no end): a schedule that must end on a published model knows where
    # Under differential privacy with ``privacy.weight_cap`` = ŵ: an update weighs min(weight / ŵ, 1) and the
    # weighted sum is divided by the number of updates (DP-FedAvg's fixed denominator; FedAvg and its kin).
    weight_cap: float = 0.0

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> Strategy:
        """Build from the ``[strategy]`` table (minus ``name``); errors name ``strategy.<key>``."""
        try:
            return cls(build(cls.Options, table, where="strategy", strict=True))
        except SchemaError as exc:
            raise ValueError(f"{exc} (strategy {cls.name!r})") from None

    def configure_train(self, settings: TrainSettings, round_number: int, paces: dict[str, float]) -> TrainPlan:
        """The local training this round's task asks for, shared and per agent (``[training]`` as given by
        default); a strategy adds its own, e.g. FedProx's μ. ``paces`` holds, for the selected agents that
        delivered before, the seconds each took per unit of work (``broker_server.rounds.pace``)."""
        return TrainPlan(settings)

    def action(self, round_number: int) -> str:
        """What this round's updates are for: ``average`` (a new global model), or for strategies that
        keep models, ``swap`` or ``local``."""
        return "average"

    def begin(self, global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:  # noqa: B027 - optional hook
        """A round starts from ``global_vector`` (read-only), laid out as ``spec`` (``models.weights.flatten``)."""

    def fold_plan(self, tentative: Tentative) -> Fold | None:
        """How to fold the next update while it is being checked, or None to leave it for ``aggregate``."""
        return None

    def unfold(self, contribution: Contribution) -> None:  # noqa: B027 - optional hook
        """Take back what ``fold_plan`` folded of ``contribution``: it is left out of the round (screened)."""

    @abstractmethod
    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        """The next global vector from the round's contributions (never empty)."""

    def average(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        """``aggregate`` up to a server optimizer's step (all of it for strategies without one): under
        differential privacy the noise is added to this, and ``server_step`` is post-processing."""
        return self.aggregate(global_vector, contributions)

    def dp_sensitivity(self, updates: int, clip: float) -> float | None:
        """How far one agent can move ``average``'s result (L2) when ``updates`` updates clipped to ``clip`` are
        aggregated: differential privacy's noise is calibrated to it (``flcore.dp_sensitivity``).
        None: no useful bound, and ``[privacy]`` refuses the strategy (asked at start for a round of
        ``capabilities.PROBE_UPDATES`` updates: a bound must not depend on how many come)."""
        return None

    def server_step(self, global_vector: np.ndarray, averaged: RoundResult) -> RoundResult:
        """The server optimizer's step from ``global_vector`` given the round's ``average`` (none here)."""
        return averaged

    def run_warnings(self, rounds: int) -> list[str]:
        """What the server should warn about at start when this strategy runs ``rounds`` rounds."""
        return []

    def run_problem(self, rounds: int) -> str:
        """Why a run of ``rounds`` rounds (0: forever) would never do what this strategy is for, or ``""``: such a
        run is refused at start, not run as another strategy."""
        return ""

    def fit_model(self, layout: Callable[[], tuple[TensorSpec, ...]]) -> str:
        """Why the strategy's options do not fit the federation's model, or ``""``: asked once when the server
        starts, so such a run is refused before its first round. ``layout()`` builds the model and lists its tensors
        in module (state_dict) order, which a published or checkpointed model no longer has (its tensors are listed
        by name). A strategy may keep what it derives (FedPer: its head's tensor names)."""
        return ""

    def plan_starts(self, models: KeptModels | None) -> StartPlan:
        """What every agent starts the next round from, and whether this round's result is published
        (``models`` is None for strategies that keep no models). Default: published, all start from it."""
        return StartPlan()

    def on_commit(self, result: RoundResult) -> None:  # noqa: B027 - optional hook
        """The round's result became the global model: update what lasts across rounds now (never in
        ``aggregate``, whose result may still be rolled back)."""

    def state(self) -> NamedArrays:
        """Arrays that must survive to the next round (kept in the checkpoint)."""
        return {}

    def restore(self, state: NamedArrays) -> None:  # noqa: B027 - optional hook
        """Resume from ``state()`` output after a restart."""


def block_width(updates: int) -> int:
    """Columns per block of ``updates`` updates: ``BLOCK_BYTES`` of them, at least ``BLOCK_MIN_COLUMNS``."""
    return max(BLOCK_MIN_COLUMNS, BLOCK_BYTES // (4 * updates))


def column_blocks(
    contributions: list[Contribution], part: int = 0, parts: int = 1
) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(start, stop, block)`` where ``block[i]`` is contribution i's clipped delta[start:stop] (float32).

    Reading all updates a column block at a time keeps RAM at ``BLOCK_BYTES`` whatever the number of
    agents (a few MB for a thousand), each update file is still read front to back, and a block is small
    enough for the kernels' several passes over it to run in cache. The block is the caller's to overwrite.
    With ``parts`` > 1, only every parts-th block from the part-th (``blas.in_parallel``'s share): the same
    blocks whatever the number of parts, so a kernel's results do not depend on it.
    """
    size, width = contributions[0].delta.size, block_width(len(contributions))
    scales = [np.float32(c.scale) for c in contributions]
    block = np.empty((len(contributions), min(width, size)), np.float32)
    for start in range(part * width, size, parts * width):
        stop = min(start + width, size)
        view = block[:, : stop - start]
        for row, (c, scale) in enumerate(zip(contributions, scales, strict=True)):
            if scale == 1:
                view[row] = c.delta[start:stop]
            else:
                np.multiply(c.delta[start:stop], scale, out=view[row])
        yield start, stop, view


def column_rows(contributions: list[Contribution]) -> Iterator[tuple[int, int, list[np.ndarray]]]:
    """``(start, stop, rows)`` where ``rows[i]`` is contribution i's clipped delta[start:stop] (float32), as
    ``column_blocks`` but read-only and without gathering: the stored values themselves where the clip scale
    is 1 (no copy), scaled into a buffer where it is not. For kernels that read every update once per block."""
    size, width = contributions[0].delta.size, block_width(len(contributions))
    scales = [np.float32(c.scale) for c in contributions]
    scaled = {i: np.empty(min(width, size), np.float32) for i, s in enumerate(scales) if s != 1}
    for start in range(0, size, width):
        stop = min(start + width, size)
        rows = []
        for i, (c, scale) in enumerate(zip(contributions, scales, strict=True)):
            values = c.delta[start:stop]
            rows.append(values if scale == 1 else np.multiply(values, scale, out=scaled[i][: stop - start]))
        yield start, stop, rows


def weighted_sum(contributions: list[Contribution], weights: np.ndarray) -> np.ndarray:
    """Σᵢ weightsᵢ·(clipped delta)ᵢ in float32, a cache-sized block of the result at a time: each update's
    values read once where they are stored (0.6x a copy of them, against 1.0x gathering a block first)."""
    out = np.zeros(contributions[0].delta.size, np.float32)
    for start, stop, rows in column_rows(contributions):
        for row, weight in zip(rows, weights, strict=True):
            if weight:
                blas.saxpy(row, out[start:stop], a=float(weight))
    return out


def mean_of_models(global_vector: np.ndarray, contributions: list[Contribution], weights: np.ndarray) -> np.ndarray:
    """Σ wₖ·modelₖ / Σ wₖ over the round's kept models (``Contribution.model``), accumulated in float32 a
    cache-sized block at a time (``weighted_sum``: the same sums, in the same order, as whole-model saxpys)."""
    assert all(c.model is not None for c in contributions)  # keeps_models
    models = [replace(c, delta=c.model, scale=1.0) for c in contributions]
    return weighted_sum(models, weights / weights.sum())


class ModelDifference:
    """A kept model minus the global one, as an aggregation sees a delta: read a column block at a time
    (``column_blocks``) or whole (``np.asarray``, one model at a time), never all of them in RAM at once."""

    def __init__(self, model: np.ndarray, base: np.ndarray) -> None:
        self.model, self.base = model, base
        self.size, self.shape, self.dtype = model.size, model.shape, np.dtype(np.float32)

    def __getitem__(self, key: slice) -> np.ndarray:
        return self.model[key] - self.base[key]

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        return np.subtract(self.model, self.base, dtype=dtype or np.float32)


def model_differences(global_vector: np.ndarray, contributions: list[Contribution]) -> list[Contribution]:
    """The round's kept models (``Contribution.model``) as contributions whose delta is the model's difference
    from the global one, unclipped (the bounds applied to each round's step), so that any aggregation of
    deltas combines models."""
    out = []
    for c in contributions:
        assert c.model is not None  # keeps_models
        difference = ModelDifference(c.model, global_vector)
        norm = math.sqrt(sum(float(np.dot(b, b)) for b in _blocks(difference)))
        out.append(Contribution(c.agent, difference, c.samples, 1.0, norm))  # type: ignore[arg-type]
    return out


def _blocks(difference: ModelDifference, width: int = 1 << 20) -> Iterator[np.ndarray]:
    for start in range(0, difference.size, width):
        yield difference[start : start + width]
