"""Federated Averaging (FedAvg) [McMahan et al., 2017]. Paper: https://arxiv.org/abs/1602.05629

The new global model is the current one plus the average of the agents' clipped deltas, weighted by
their (capped) sample counts (``weighting = "samples"``, the paper's n_k/n) or equally
(``"uniform"``). Streaming: each update is folded into one float32 running sum while it is checked
(``flcore.onepass``), with the bounds known so far; at the end the few updates whose exact
coefficient differs (deferred ones, or ones the final clip bound or sample cap reached) are corrected
from the stored update. If a tentative coefficient was far larger than the exact one, the sum is
rebuilt from the stored updates instead, so no large value is ever cancelled in float32.

Under differential privacy with ``privacy.weight_cap`` ŵ (DP-FedAvg with weights, McMahan, Ramage,
Talwar & Zhang, ICLR 2018, arXiv:1710.06963, Alg. 1's fixed-denominator estimator): an update weighs
wₖ = min(nₖ / ŵ, 1) for its capped sample (or object) count nₖ, and the weighted sum is divided by the
number of updates n, not by Σ wₖ. Why n and the sensitivity S/n: ``flcore.dp_sensitivity``.

Memory: one float32 vector the size of the model, whatever the number of agents (updates wait on disk).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flcore.bounds import Tentative
from flcore.dp_sensitivity import mean_sensitivity
from flcore.onepass import Fold, axpy
from flcore.strategies.base import Contribution, RoundResult, Strategy
from models.weights import TensorSpec

WEIGHTINGS = ("samples", "uniform")
REBUILD_FACTOR = 16.0  # a fold this many times the largest exact contribution is recomputed, not corrected


@dataclass(frozen=True)
class FedAvgOptions:
    weighting: str = "samples"

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"strategy.weighting {self.weighting!r} must be one of {WEIGHTINGS}")


class FedAvg(Strategy):
    """Streaming, sample-weighted FedAvg over clipped deltas."""

    name = "fedavg"
    Options = FedAvgOptions
    bounded_by_clip = True
    weighted = True  # weights in [0, 1] over the number of updates under privacy (``weight``)

    def __init__(self, options: FedAvgOptions | None = None) -> None:
        super().__init__(options)
        self._sum = np.zeros(0, np.float32)

    def weight(self, samples: float) -> float:
        if self.options.weighting == "uniform":
            return 1.0
        return min(max(samples / self.weight_cap, 0.0), 1.0) if self.weight_cap else float(samples)

    def dp_sensitivity(self, updates: int, clip: float) -> float:
        return mean_sensitivity(updates, clip)

    def begin(self, global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:
        self._sum = np.zeros_like(global_vector, dtype=np.float32)

    def fold_plan(self, tentative: Tentative) -> Fold | None:
        if self.options.weighting == "samples" and tentative.samples is None:
            return None
        return Fold(self._sum, self.weight(tentative.samples or 1.0), tentative.max_norm)

    def unfold(self, contribution: Contribution) -> None:
        if contribution.folded:
            axpy(contribution.delta, self._sum, -contribution.folded)

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        weights = np.array([self.weight(c.samples) for c in contributions])
        exact = weights * np.array([c.scale for c in contributions])
        folded = np.array([c.folded for c in contributions])
        norms = np.array([c.norm for c in contributions])
        largest = float(np.max(exact * norms, initial=0.0))
        if float(np.max(folded * norms, initial=0.0)) > REBUILD_FACTOR * max(largest, 1e-30):
            self._sum[:] = 0
            folded = np.zeros_like(folded)
        corrected = 0
        for c, target, already in zip(contributions, exact, folded, strict=True):
            if target != already:
                axpy(c.delta, self._sum, float(target - already))
                corrected += 1
        total = float(len(contributions) if self.weight_cap else weights.sum())  # DP-FedAvg: a fixed denominator
        if total <= 0:
            return RoundResult(global_vector.copy())
        new = global_vector + self._sum * np.float32(1.0 / total)
        return RoundResult(new, {"refolded": corrected})
