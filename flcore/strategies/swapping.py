"""Server-mediated model swapping: ``fedswap`` (Chiu et al. 2020, ref. [9] of the thesis below, whose
Alg. 4-1 restates it) and ``simfedswap`` (Bozorgzad 2024, "Smart Swapping Approach Based on Neural
Network Models Similarity for Enhancing Federated Learning", M.Sc. thesis, Isfahan University of
Technology; seed 004).

Every agent keeps its own model across rounds. Round t's updates are for ``fedswap_action(t, h1, h2)``
(``flcore.pairing``): ``local`` (each agent goes on from its own model), ``swap`` (pairs of
agents exchange models through the server: each receives its partner's model sealed to it alone) or
``average`` (the sample-weighted mean of the agents' models becomes the new global model, which every
agent then starts from). FedSwap pairs at random; SimFedSwap pairs the *least similar* models
(``pairing = "mss"`` by default, or ``"gs"``), similarity on the weights layer by layer
(``flcore.similarity``: ``osad``, ``cca``, ``hsic``, ``cka``, ``rbf-cka``, ``dcka``).

The schedule is a layer over any aggregation: an ``average`` round combines the agents' models with
``aggregate`` (``fedavg`` by default, the thesis's WeightedAvg; or ``krum``, ``median``, ``trimmed-mean``,
``centered-clip``, a server optimizer, ``auto``), which sees each model as its difference from the global
model, as it sees deltas in a plain round. A run's last round (``server.rounds``) is always an average, so a
run never ends on a global model that no training reached.

``local`` rounds upload nothing: agents train on and keep their models; the next upload is each agent's
change from the model the server named to it (``broker_server.rounds.local_rounds``), so the thesis's traffic
saving of (h1 − 1)/h1 holds. Choices where the thesis is silent (docs/strategies.md): only the agents whose
update was accepted this round are paired; an agent left unpaired (odd count, ``sp`` < 1) goes on from its
own model; an agent not selected keeps whatever it was to start from. A ``swap`` round publishes no global
model; its ``eval`` is that of what an ``average`` would give from the round's models. Under differential
privacy every model a swap hands out is released noised (``broker_server.privacy.gaussian.release``).

Memory at the end of a round: one model-sized float32 vector for the mean, plus, for similarity
pairing, the weight tensors of every agent whose update was accepted (N × the model's size); the
agents' models themselves are memory-mapped files (``flcore.agent_models``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from flcore.agent_models import Assignment
from flcore.pairing import PAIRINGS, fedswap_action, pair_agents
from flcore.similarity import METRICS, similarity_matrix, weight_layers
from flcore.strategies import STRATEGIES
from flcore.strategies.base import (
    KEPT_MODELS_NOT_PEERS,
    Contribution,
    KeptModels,
    NamedArrays,
    RoundResult,
    StartPlan,
    Strategy,
    model_differences,
)
from flcore.strategies.fedavg import WEIGHTINGS
from models.weights import TensorSpec, unflatten
from protocol.typed import SchemaError, build

# What an ``average`` round may combine the models with: the strategies that aggregate deltas on the server
# alone (FedProx's μ is the agents' training, and model-keeping strategies cannot nest).
AGGREGATIONS = ("fedavg", "krum", "median", "trimmed-mean", "centered-clip", "fedavgm", "fedadam", "fedyogi", "auto")


@dataclass(frozen=True)
class SwapOptions:
    h1: int = 5  # rounds between swaps (the thesis's MNIST setting, Table 5-2)
    h2: int = 3  # swaps per averaging period, counting the average
    sp: float = 1.0  # swap fraction: int((n // 2) * sp) pairs, the thesis's NS
    pairing: str = "random"
    similarity: str = "osad"
    weighting: str = "samples"
    aggregate: str = "fedavg"  # how an average round combines the models (AGGREGATIONS)
    aggregate_options: dict = field(default_factory=dict)  # its [strategy] options, e.g. {f = 1} for krum

    def __post_init__(self) -> None:
        if self.h1 < 1:
            raise ValueError(f"strategy.h1 must be >= 1 (rounds between swaps), got {self.h1}")
        if self.h2 < 1:
            raise ValueError(f"strategy.h2 must be >= 1 (swaps per averaging period, counting it), got {self.h2}")
        if not 0 <= self.sp <= 1:
            raise ValueError(f"strategy.sp must be in [0, 1] (the fraction of agents that swap), got {self.sp}")
        if self.pairing not in PAIRINGS:
            raise ValueError(f"strategy.pairing {self.pairing!r} must be one of {', '.join(PAIRINGS)}")
        if self.similarity not in METRICS:
            raise ValueError(f"strategy.similarity {self.similarity!r} must be one of {', '.join(METRICS)}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"strategy.weighting {self.weighting!r} must be one of {WEIGHTINGS}")
        if self.aggregate not in AGGREGATIONS:
            raise ValueError(f"strategy.aggregate {self.aggregate!r} must be one of {', '.join(AGGREGATIONS)}")


@dataclass(frozen=True)
class SimSwapOptions(SwapOptions):
    pairing: str = "mss"  # the thesis's default in every main experiment


class ModelSwapping(Strategy):
    """Base of the strategies that keep every agent's model: the schedule, the aggregation of the agents'
    models, where each agent starts from (``plan_starts``), and ``pairs`` (FedSwap's random pairs;
    subclasses may pair otherwise)."""

    name = "fedswap"
    Options = SwapOptions
    keeps_models = True
    swaps = True
    peers = KEPT_MODELS_NOT_PEERS

    def __init__(self, options: SwapOptions | None = None) -> None:
        super().__init__(options)
        self.inner = aggregation(self.options)
        self._published = False  # whether the round being closed publishes (``plan_starts`` decides)

    def action(self, round_number: int) -> str:
        if round_number == self.last_round:
            return "average"
        return fedswap_action(round_number, self.options.h1, self.options.h2)

    def run_warnings(self, rounds: int) -> list[str]:
        cycle = self.options.h1 * self.options.h2
        if rounds % cycle == 0:
            return []
        return [f"server.rounds = {rounds} is not a multiple of h1*h2 = {cycle}: round {rounds} averages early, so "
                f"the run ends on a published global model ({rounds % cycle} rounds into a swap cycle)"]  # fmt: skip

    def begin(self, global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:
        self.inner.begin(global_vector, spec)

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        """``aggregate`` over the round's models, each as its difference from the global model (FedSwap's
        WeightedAvg for ``fedavg``: Σ wₖ·modelₖ / Σ wₖ, wₖ = capped samples or 1)."""
        return self.inner.aggregate(global_vector, model_differences(global_vector, contributions))

    def average(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        """Under differential privacy: the aggregation's average only (the noise goes on it, then ``server_step``)."""
        return self.inner.average(global_vector, model_differences(global_vector, contributions))

    def server_step(self, global_vector: np.ndarray, averaged: RoundResult) -> RoundResult:
        return self.inner.server_step(global_vector, averaged)

    def dp_sensitivity(self, updates: int, clip: float) -> float | None:
        """An average round's: each model is an earlier release plus its owner's clipped change (``gaussian.release``),
        so the mean of the models moves as the mean of clipped deltas does (``privacy`` admits only means)."""
        return self.inner.dp_sensitivity(updates, clip)

    def on_commit(self, result: RoundResult) -> None:
        if self._published:  # a server optimizer's moments, centered clipping's reference: average rounds only
            self.inner.on_commit(result)

    def state(self) -> NamedArrays:
        return {f"aggregate/{k}": v for k, v in self.inner.state().items()}

    def restore(self, state: NamedArrays) -> None:
        self.inner.restore({k.removeprefix("aggregate/"): v for k, v in state.items() if k.startswith("aggregate/")})

    def plan_starts(self, models: KeptModels | None) -> StartPlan:
        """``average``: the mean is published and everyone starts from it; ``local``: each agent whose update
        counted goes on from its own model; ``swap``: pairs of them exchange models (an unpaired one goes on
        from its own). Agents whose update did not count keep what they had (``agent_models.settle``)."""
        assert models is not None  # keeps_models
        self._published = models.action == "average"
        if models.action == "average":
            return StartPlan()
        starts = {agent: models.own(agent) for agent in models.agents}
        if models.action != "swap":
            return StartPlan(publish=False, starts=starts)
        kept = models.kept
        if models.release is not None:  # differential privacy: every model leaves noised, its owner's own too
            kept = {agent: models.release(agent) for agent in models.agents}
            starts = {agent: Assignment("inbox", kept[agent]) for agent in models.agents}
        named = [unflatten(models.vector(kept[a]), models.spec) for a in models.agents]  # pairing: on what leaves
        pairs, detail = self.pairs(models.agents, named, models.rng())
        for a, b in pairs:
            starts[a], starts[b] = Assignment("inbox", kept[b]), Assignment("inbox", kept[a])
        return StartPlan(publish=False, starts=starts, detail=detail)

    def pairs(
        self, agents: list[str], models: list[Mapping[str, np.ndarray]], rng: np.random.Generator
    ) -> tuple[list[tuple[str, str]], dict]:
        """Who swaps with whom among ``agents`` (their models after this round, by tensor name), and what
        to report in ``metrics.aggregation``."""
        similarity = None
        if self.options.pairing != "random":
            similarity = similarity_matrix(weight_layers(models), self.options.similarity)
        chosen = pair_agents(self.options.pairing, similarity, len(agents), self.options.sp, rng)
        detail: dict = {"pairs": [[agents[i], agents[j]] for i, j in chosen]}
        if similarity is not None:
            detail["pair_similarity"] = [round(float(similarity[i, j]), 6) for i, j in chosen]
        return [(agents[i], agents[j]) for i, j in chosen], detail


def aggregation(options: SwapOptions) -> Strategy:
    """The strategy an ``average`` round uses, built from ``aggregate_options`` (FedAvg's weighting defaults
    to the swapping strategy's own)."""
    cls = STRATEGIES.get(options.aggregate)
    table = dict(options.aggregate_options)
    if "weighting" in getattr(cls.Options, "__dataclass_fields__", {}):
        table.setdefault("weighting", options.weighting)
    try:
        return cls(build(cls.Options, table, where="strategy.aggregate_options", strict=True))
    except SchemaError as exc:
        raise ValueError(f"{exc} (aggregation {options.aggregate!r})") from None


class SimFedSwap(ModelSwapping):
    """FedSwap with partners chosen by dissimilarity (MSS by default)."""

    name = "simfedswap"
    Options = SimSwapOptions
