"""Federated Median (coordinate-wise median) [Yin et al., 2018]. Paper: https://arxiv.org/abs/1803.01498

Each coordinate of the new delta is the median of that coordinate over the round's clipped deltas
("Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018), so fewer
than half of the agents cannot drag any coordinate outside the range of the honest values. Unweighted:
sample counts play no part, so an inflated claim buys nothing. Under differential privacy it is the trimmed
mean that keeps one value (two for even n), and its noise is n/2 to n times FedAvg's
(``flcore.dp_sensitivity``): of the order of the clip bound on every value, whatever the fleet.

Memory: every update of the round stays in the on-disk update store; aggregation reads them in column
blocks sized to the CPU's cache (``column_rows``) and sorts every column of a block at once
(``flcore.order_statistics``), so RAM holds one block and the result vector whatever the number of agents.
"""

from __future__ import annotations

import numpy as np

from flcore.dp_sensitivity import trimmed_mean_sensitivity
from flcore.order_statistics import column_median
from flcore.strategies.base import Contribution, RoundResult, Strategy, column_rows


class FedMedian(Strategy):
    name = "median"

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        median = np.empty_like(global_vector, dtype=np.float32)
        for start, stop, rows in column_rows(contributions):
            column_median(rows, median[start:stop])
        return RoundResult(global_vector + median)

    def dp_sensitivity(self, updates: int, clip: float) -> float:
        return trimmed_mean_sensitivity(updates, (updates - 1) // 2, clip)
