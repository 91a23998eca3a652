"""FedProx [Li et al., 2020, "Federated Optimization in Heterogeneous Networks"]. Paper:
https://arxiv.org/abs/1812.06127

The server side is FedAvg (streaming, with the same bounds); what changes is local training: the round
task carries μ (``configure_train``) and each agent minimises F_k(w) + (μ/2)·‖w − w_t‖² from the
round's start model w_t (``models.training.train_sgd``), which limits how far a skewed agent drifts.
The paper tunes μ in {0.001, 0.01, 0.1, 1}; 0.01 is the default here. Memory: FedAvg's, plus one copy
of the model's parameters on each agent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from broker_server.strategies.fedavg import FedAvg, FedAvgOptions
from protocol.messages import TrainSettings


@dataclass(frozen=True)
class FedProxOptions(FedAvgOptions):
    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mu < 0:
            raise ValueError(f"strategy.mu must be >= 0 (0 = FedAvg), got {self.mu}")


class FedProx(FedAvg):
    name = "fedprox"
    Options = FedProxOptions

    def configure_train(self, settings: TrainSettings, round_number: int) -> TrainSettings:
        return replace(settings, prox_mu=self.options.mu)
