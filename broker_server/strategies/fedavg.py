"""Federated Averaging (FedAvg) [McMahan et al., 2017]. Paper: https://arxiv.org/abs/1602.05629

The new global model is the current one plus the average of the agents' deltas, weighted by their
sample counts (``weighting="samples"``, the paper's n_k/n) or equally (``"uniform"``). It is computed
as a streaming weighted sum: one float32 accumulator the size of the model, folded with one BLAS
``saxpy`` per update, so memory does not grow with the number of agents and each update is read once.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg.blas import saxpy

from broker_server.strategies.base import AcceptedUpdate, NamedArrays, RoundResult, Strategy

WEIGHTINGS = ("samples", "uniform")


def fold(accumulator: np.ndarray, delta: np.ndarray, weight: float) -> None:
    """accumulator += weight * delta, in place, in one pass (float32 BLAS saxpy)."""
    result = saxpy(delta, accumulator, a=weight)
    if result is not accumulator and not np.shares_memory(result, accumulator):  # pragma: no cover
        raise RuntimeError("saxpy did not update the accumulator in place")


def weighted_mean_step(global_vector: np.ndarray, weighted_sum: np.ndarray, total_weight: float) -> np.ndarray:
    """global + weighted_sum / total_weight (the FedAvg server step with learning rate 1)."""
    if total_weight <= 0:
        return global_vector.copy()
    return global_vector + weighted_sum * np.float32(1.0 / total_weight)


class FedAvg(Strategy):
    """Streaming, sample-weighted FedAvg."""

    name = "fedavg"

    def __init__(self, weighting: str = "samples") -> None:
        if weighting not in WEIGHTINGS:
            raise ValueError(f"strategy.weighting {weighting!r} must be one of {WEIGHTINGS}")
        self.weighting = weighting
        self._global = np.zeros(0, np.float32)
        self._sum = np.zeros(0, np.float32)
        self._total = 0.0

    def begin(self, global_vector: np.ndarray) -> None:
        self._global = global_vector
        self._sum = np.zeros_like(global_vector, dtype=np.float32)
        self._total = 0.0

    def weight_of(self, update: AcceptedUpdate) -> float:
        return float(update.samples) if self.weighting == "samples" else 1.0

    def accumulate(self, update: AcceptedUpdate) -> None:
        weight = self.weight_of(update)
        fold(self._sum, update.delta, weight)
        self._total += weight

    def finalize(self) -> RoundResult:
        return RoundResult(weighted_mean_step(self._global, self._sum, self._total))

    def state(self) -> NamedArrays:
        return {"weighted_sum": self._sum, "total_weight": np.array([self._total], np.float64)}

    def restore(self, global_vector: np.ndarray, state: NamedArrays) -> None:
        self._global = global_vector
        self._sum = np.array(state["weighted_sum"], dtype=np.float32)
        self._total = float(state["total_weight"][0])
