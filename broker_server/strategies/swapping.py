"""Server-mediated model swapping: ``fedswap`` (Chiu et al. 2020, ref. [9] of the thesis below, whose
Alg. 4-1 restates it) and ``simfedswap`` (Bozorgzad 2024, "Smart Swapping Approach Based on Neural
Network Models Similarity for Enhancing Federated Learning", M.Sc. thesis, Isfahan University of
Technology; seed 004).

Every agent keeps its own model across rounds. Round t's updates are for ``fedswap_action(t, h1, h2)``
(``broker_server.pairing``): ``local`` (each agent goes on from its own model), ``swap`` (pairs of
agents exchange models through the server: each receives its partner's model sealed to it alone) or
``average`` (the sample-weighted mean of the agents' models becomes the new global model, which every
agent then starts from). FedSwap pairs at random; SimFedSwap pairs the *least similar* models
(``pairing = "mss"`` by default, or ``"gs"``), similarity on the weights layer by layer
(``broker_server.similarity``: ``osad``, ``cca``, ``hsic``, ``cka``, ``rbf-cka``, ``dcka``).

Choices where the thesis is silent (docs/strategies.md): agents that upload in every round, also
``local`` ones (so validation and the influence bounds apply to every step, and the server always
knows each agent's model; the thesis's traffic saving of (h1 − 1)/h1 is given up on the uplink, not
on the downlink); only the agents whose update was accepted this round are paired; an agent left
unpaired (odd count, ``sp`` < 1) goes on from its own model; an agent not selected keeps whatever it
was to start from. A ``swap`` or ``local`` round publishes no global model; its ``eval`` is that of the
mean of the round's models (what an ``average`` would give), so curves stay comparable with FedAvg.

Memory at the end of a round: one model-sized float32 vector for the mean, plus, for similarity
pairing, the weight tensors of every agent whose update was accepted (N × the model's size); the
agents' models themselves are memory-mapped files (``broker_server.agent_models``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from broker_server.agent_models import Assignment
from broker_server.pairing import PAIRINGS, fedswap_action, pair_agents
from broker_server.similarity import METRICS, similarity_matrix, weight_layers
from broker_server.strategies.base import (
    Contribution,
    KeptModels,
    RoundResult,
    StartPlan,
    Strategy,
    mean_of_models,
)
from broker_server.strategies.fedavg import WEIGHTINGS
from models.weights import unflatten


@dataclass(frozen=True)
class SwapOptions:
    h1: int = 5  # rounds between swaps (the thesis's MNIST setting, Table 5-2)
    h2: int = 3  # swaps per averaging period, counting the average
    sp: float = 1.0  # swap fraction: int((n // 2) * sp) pairs, the thesis's NS
    pairing: str = "random"
    similarity: str = "osad"
    weighting: str = "samples"

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


@dataclass(frozen=True)
class SimSwapOptions(SwapOptions):
    pairing: str = "mss"  # the thesis's default in every main experiment


class ModelSwapping(Strategy):
    """Base of the strategies that keep every agent's model: the schedule, the weighted mean of the
    agents' models, where each agent starts from (``plan_starts``), and ``pairs`` (FedSwap's random
    pairs; subclasses may pair otherwise)."""

    name = "fedswap"
    Options = SwapOptions
    keeps_models = True

    def action(self, round_number: int) -> str:
        return fedswap_action(round_number, self.options.h1, self.options.h2)

    def run_warnings(self, rounds: int) -> list[str]:
        cycle = self.options.h1 * self.options.h2
        if rounds % cycle == 0:
            return []
        return [f"server.rounds = {rounds} is not a multiple of h1*h2 = {cycle}: the last {rounds % cycle} rounds' "
                f"training never reaches the final global model"]  # fmt: skip

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        """Σ wₖ·modelₖ / Σ wₖ over the round's models (FedSwap's WeightedAvg, wₖ = capped samples or 1)."""
        weights = np.array([c.samples if self.options.weighting == "samples" else 1.0 for c in contributions])
        return RoundResult(mean_of_models(global_vector, contributions, weights))

    def plan_starts(self, models: KeptModels | None) -> StartPlan:
        """``average``: the mean is published and everyone starts from it; ``local``: each agent whose update
        counted goes on from its own model; ``swap``: pairs of them exchange models (an unpaired one goes on
        from its own). Agents whose update did not count keep what they had (``agent_models.settle``)."""
        assert models is not None  # keeps_models
        if models.action == "average":
            return StartPlan()
        starts = {agent: models.own(agent) for agent in models.agents}
        if models.action != "swap":
            return StartPlan(publish=False, starts=starts)
        named = [unflatten(models.vector(models.kept[a]), models.spec) for a in models.agents]
        pairs, detail = self.pairs(models.agents, named, models.rng())
        for a, b in pairs:
            starts[a], starts[b] = Assignment("inbox", models.kept[b]), Assignment("inbox", models.kept[a])
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


class SimFedSwap(ModelSwapping):
    """FedSwap with partners chosen by dissimilarity (MSS by default)."""

    name = "simfedswap"
    Options = SimSwapOptions
