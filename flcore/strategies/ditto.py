"""Ditto [Li, Hu, Beirami & Smith, ICML 2021, "Ditto: Fair and Robust Federated Learning Through Personalization",
https://arxiv.org/abs/2012.04221].

Each agent keeps a personal model vₖ beside the federation's global model w. In a round an agent (Algorithm 1)
trains w from the round's global model wᵗ as FedAvg does and uploads that update, and trains its personal model
on min F_k(v) + (λ/2)·‖v − wᵗ‖² (the ``ditto`` recipe, ``participant.recipes.ditto``); the personal model never
leaves the agent. λ interpolates between local training (0) and the global model (large); the paper picks it from
{0.05, 0.1, 0.2, 0.5, 1, 2} per dataset.

The server half is FedAvg's, unchanged: the same bounds, the same sensitivity under central differential privacy
(only w's clipped updates are aggregated and released), and it runs between peers. What an agent is judged by is
its personal model (``models = "agent"``): its C-SPE is that model on its own test split, measured before it
trains each round.
"""

from __future__ import annotations

from dataclasses import dataclass

from flcore.strategies.base import TrainPlan, asking
from flcore.strategies.fedavg import FedAvg, FedAvgOptions
from protocol.messages import TrainSettings


@dataclass(frozen=True)
class DittoOptions(FedAvgOptions):
    lam: float = 0.1  # λ: the personal model's pull toward the global model
    personal_epochs: int = 0  # the personal model's epochs per round (0: the round's training.epochs)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.lam >= 0:
            raise ValueError(f"strategy.lam must be >= 0 (0: personal models train alone), got {self.lam}")
        if self.personal_epochs < 0:
            raise ValueError(f"strategy.personal_epochs must be >= 0 (0: training.epochs), got {self.personal_epochs}")


class Ditto(FedAvg):
    name = "ditto"
    Options = DittoOptions
    models = "agent"
    tasks = frozenset({"classify"})
    why_not_tasks = "trains each agent's personal model with a proximal pull, which the detector trainer does not have"

    def configure_train(self, settings: TrainSettings, round_number: int, paces: dict[str, float]) -> TrainPlan:
        o = self.options
        return TrainPlan(asking(settings, "ditto", lam=o.lam, epochs=o.personal_epochs or settings.epochs))
