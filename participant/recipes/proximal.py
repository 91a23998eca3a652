"""The proximal pull: local training minimises F_k(w) + (μ/2)·‖w − w_t‖² from the round's start model w_t, which
limits how far a skewed participant drifts (FedProx: Li et al., MLSys 2020, https://arxiv.org/abs/1812.06127;
FedAMP's and DemLearn's client step, FedAMN's λ toward the meta-network's output; docs/strategies.md).
Under local DP-SGD the term is left out: a whole-model term has no per-sample gradient to clip."""

from __future__ import annotations

from dataclasses import dataclass, replace

from participant.recipes.base import Knobs, Recipe


@dataclass(frozen=True)
class ProximalOptions:
    mu: float = 0.01

    def __post_init__(self) -> None:
        if not self.mu >= 0:
            raise ValueError(f"mu must be >= 0 (0: no pull), got {self.mu}")


class ProximalPull(Recipe):
    name = "proximal"
    Options = ProximalOptions

    def knobs(self, knobs: Knobs) -> Knobs:
        return replace(knobs, prox_mu=self.options.mu)
