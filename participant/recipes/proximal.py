"""The proximal pull: local training minimises F_k(w) + (μ/2)·‖w − a‖², a the round's start model w_t, which
limits how far a skewed participant drifts (FedProx: Li et al., MLSys 2020, https://arxiv.org/abs/1812.06127;
FedAMP's and DemLearn's client step, FedAMN's λ toward the meta-network's output; docs/strategies.md).
``toward = "peer"`` aims it at the one model sent beside the start instead (``LocalRun.context``): FedAMP in its
paper's form, where an agent trains on from its own model wᵢ pulled toward its cloud model uᵢ
(``flcore.strategies.fedamp``, ``start = "own"``); with nothing sent beside the start (a first round) it pulls
toward the start. Under local DP-SGD the term is left out: a whole-model term has no per-sample gradient to clip."""

from __future__ import annotations

from dataclasses import dataclass, replace

from participant.declined import TrainingDeclined
from participant.recipes.base import Knobs, LocalRun, Recipe

TOWARD = ("start", "peer")


@dataclass(frozen=True)
class ProximalOptions:
    mu: float = 0.01
    toward: str = "start"  # the anchor a: the start model, or the one model sent beside it

    def __post_init__(self) -> None:
        if not self.mu >= 0:
            raise ValueError(f"mu must be >= 0 (0: no pull), got {self.mu}")
        if self.toward not in TOWARD:
            raise ValueError(f"toward must be one of {', '.join(TOWARD)}, got {self.toward!r}")


class ProximalPull(Recipe):
    name = "proximal"
    Options = ProximalOptions

    def knobs(self, knobs: Knobs) -> Knobs:
        return replace(knobs, prox_mu=self.options.mu)

    def before(self, run: LocalRun) -> None:
        if self.options.toward == "start" or run.context is None:
            return
        rows = {len(stack) for stack in run.context.peers.values()}
        if rows != {1}:
            raise TrainingDeclined(f"recipe proximal toward 'peer' needs exactly one model sent beside the start, "
                                   f"got {sorted(rows)} rows")  # fmt: skip
        run.anchor = {name: stack[0] for name, stack in run.context.peers.items()}
