"""Coordinate-wise trimmed mean [Yin et al., 2018]. Paper: https://arxiv.org/abs/1803.01498

For each coordinate, the ``beta`` fraction of largest and of smallest values over the round's
clipped deltas are dropped and the rest averaged (the paper's β-trimmed mean; Flower calls it
FedTrimmedAvg). With f attackers out of n it tolerates f ≤ beta·n. If too few updates are left to
trim (n - 2·floor(beta·n) < 1), as many as possible are trimmed while keeping one. Unweighted.
Under differential privacy its noise is n / (n − 2k) times FedAvg's (``flcore.dp_sensitivity``):
1.67× at the default beta.

Memory: as ``median``: updates stay on disk, read and sorted in cache-sized column blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flcore.dp_sensitivity import trimmed_mean_sensitivity
from flcore.order_statistics import column_trimmed_mean
from flcore.strategies.base import Contribution, RoundResult, Strategy, column_rows


@dataclass(frozen=True)
class TrimmedMeanOptions:
    beta: float = 0.2

    def __post_init__(self) -> None:
        if not 0 <= self.beta < 0.5:
            raise ValueError(f"strategy.beta must be in [0, 0.5) (the fraction trimmed at each end), got {self.beta}")


def trim_count(n: int, beta: float) -> int:
    """Values dropped at each end of a column of ``n``."""
    return min(int(np.floor(beta * n)), (n - 1) // 2)


class TrimmedMean(Strategy):
    name = "trimmed-mean"
    Options = TrimmedMeanOptions

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        n = len(contributions)
        k = trim_count(n, self.options.beta)
        mean = np.empty_like(global_vector, dtype=np.float32)
        for start, stop, rows in column_rows(contributions):
            column_trimmed_mean(rows, k, mean[start:stop])
        return RoundResult(global_vector + mean, {"trimmed_per_side": k})

    def dp_sensitivity(self, updates: int, clip: float) -> float:
        return trimmed_mean_sensitivity(updates, trim_count(updates, self.options.beta), clip)
