"""FedProx [Li et al., 2020, "Federated Optimization in Heterogeneous Networks"]. Paper:
https://arxiv.org/abs/1812.06127

The server side is FedAvg (streaming, with the same bounds); what changes is local training: the round
task carries μ (``configure_train``) and each agent minimises F_k(w) + (μ/2)·‖w − w_t‖² from the
round's start model w_t (``models.training.train_sgd``), which limits how far a skewed agent drifts.
The paper tunes μ in {0.001, 0.01, 0.1, 1}; 0.01 is the default here.

Partial work (``partial_work = true``): the paper's answer to systems heterogeneity is to let slow
devices do less local work instead of being dropped (its experiments drop 0-90 % "stragglers" under
FedAvg and keep their partial solutions under FedProx; Section 5.2). The paper varies the work at
random; here the server sets it per agent from the pace it measured (``broker_server.rounds.pace``): an
agent slower than the median selected agent gets work = median pace / its pace (at least
``min_work``), so it needs about as long as the median agent needs for the full work, and a round that
waits for everyone (no threshold) no longer waits for the slowest. Unknown agents do the full work.
Memory: FedAvg's, plus one copy of the model's parameters on each agent.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from flcore.strategies.base import TrainPlan, asking
from flcore.strategies.fedavg import FedAvg, FedAvgOptions
from protocol.messages import TrainSettings


@dataclass(frozen=True)
class FedProxOptions(FedAvgOptions):
    mu: float = 0.01
    partial_work: bool = False
    min_work: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mu < 0:
            raise ValueError(f"strategy.mu must be >= 0 (0 = FedAvg), got {self.mu}")
        if not 0 < self.min_work <= 1:
            raise ValueError(
                f"strategy.min_work must be in (0, 1] (the least share of local work a slow agent is asked for), "
                f"got {self.min_work}"
            )


def partial_work(paces: dict[str, float], min_work: float) -> dict[str, float]:
    """Agent → share of the local work, for the agents slower than the median pace (the others: 1)."""
    if not paces:
        return {}
    target = statistics.median(paces.values())
    return {a: round(max(min_work, target / pace), 3) for a, pace in sorted(paces.items()) if pace > target}


class FedProx(FedAvg):
    name = "fedprox"
    Options = FedProxOptions
    tasks = frozenset({"classify"})
    why_not_tasks = "needs a proximal term in local training, which the detector trainer does not have"

    def __init__(self, options: FedProxOptions | None = None) -> None:
        super().__init__(options)
        if self.options.partial_work:  # this instance's own answer: peers run FedProx, but measure no paces
            self.peers = "strategy.partial_work sets each agent's share from paces a server measures; peers have none"

    def configure_train(self, settings: TrainSettings, round_number: int, paces: dict[str, float]) -> TrainPlan:
        shared = asking(settings, "proximal", mu=self.options.mu)
        if not self.options.partial_work:
            return TrainPlan(shared)
        work = partial_work(paces, self.options.min_work)
        return TrainPlan(shared, {agent: asking(shared, "partial-work", share=w) for agent, w in work.items()})
