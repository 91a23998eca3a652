"""Server optimizers on FedAvg's pseudo-gradient: ``fedavgm``, ``fedadam``, ``fedyogi``.

The round's bounded FedAvg change Δ (``FedAvg.aggregate``, streaming as usual) is treated as a
gradient step and fed to an optimizer that keeps state across rounds (in the checkpoint):

- FedAvgM [Hsu, Qi & Brown 2019, https://arxiv.org/abs/1909.06335]: v ← β·v + Δ, x ← x + η·v;
- FedAdam and FedYogi [Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2,
  https://arxiv.org/abs/2003.00295]: m ← β₁·m + (1 − β₁)·Δ, then
  Adam v ← β₂·v + (1 − β₂)·Δ², Yogi v ← v − (1 − β₂)·Δ²·sign(v − Δ²), and x ← x + η·m / (√v + τ)
  (no bias correction, as in the paper).

Defaults: FedAvgM β = 0.9, η = 1 (Hsu et al.); Adam/Yogi β₁ = 0.9, β₂ = 0.99, τ = 1e-3 (the paper's
choices) and η = 0.01 (ours: an adaptive step moves every coordinate by about η per round, and 0.01
suits the digits CNN; the paper tunes η per task). BatchNorm running statistics are averages, not
gradients: they take the plain FedAvg change (an optimizer step could drive a variance negative).
Memory: one (FedAvgM) or two (Adam, Yogi) model-sized float32 vectors besides FedAvg's running sum.
Under differential privacy the noise goes on Δ (``average``) and the optimizer steps on the noisy Δ
(``server_step``), so its state is post-processing of published values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flcore.strategies.base import Contribution, NamedArrays, RoundResult
from flcore.strategies.fedavg import FedAvg, FedAvgOptions
from models.weights import RUNNING_STATISTICS, TensorRange, TensorSpec, ranges_of


@dataclass(frozen=True)
class MomentumOptions(FedAvgOptions):
    server_lr: float = 1.0
    momentum: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server_lr <= 0:
            raise ValueError(f"strategy.server_lr must be > 0, got {self.server_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"strategy.momentum must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class AdaptiveOptions(FedAvgOptions):
    server_lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server_lr <= 0 or self.tau <= 0:
            raise ValueError(f"strategy.server_lr and strategy.tau must be > 0, got {self.server_lr}, {self.tau}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"strategy.{key} must be in [0, 1), got {getattr(self, key)}")


class _ServerOptimizer(FedAvg):
    """FedAvg's change, then ``step``; statistics keep the plain change. Subclasses say ``step``."""

    bounded_by_clip = False  # the optimizer's step is not a convex combination of clipped deltas
    peers = "it steps a server optimizer over the averaged update, which peers do not run"
    state_names: tuple[str, ...] = ()

    def __init__(self, options: FedAvgOptions | None = None) -> None:
        super().__init__(options)
        self.state_arrays: dict[str, np.ndarray] = {}
        self._pending: dict[str, np.ndarray] = {}
        self.statistics: tuple[TensorRange, ...] = ()

    def begin(self, global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:
        super().begin(global_vector, spec)
        self.statistics = ranges_of(spec, RUNNING_STATISTICS)
        for name in self.state_names:
            if self.state_arrays.get(name, np.zeros(0)).size != global_vector.size:
                self.state_arrays[name] = np.zeros_like(global_vector, dtype=np.float32)

    def step(self, delta: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The change to apply, and the new optimizer state (kept only if the round is committed)."""
        raise NotImplementedError

    def average(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        return super().aggregate(global_vector, contributions)

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        return self.server_step(global_vector, self.average(global_vector, contributions))

    def server_step(self, global_vector: np.ndarray, averaged: RoundResult) -> RoundResult:
        delta = averaged.global_vector - global_vector
        change, self._pending = self.step(delta)
        for r in self.statistics:
            change[r.start : r.stop] = delta[r.start : r.stop]
        return RoundResult(global_vector + change, averaged.detail)

    def on_commit(self, result: RoundResult) -> None:
        self.state_arrays.update(self._pending)

    def state(self) -> NamedArrays:
        return dict(self.state_arrays)

    def restore(self, state: NamedArrays) -> None:
        self.state_arrays = {k: np.asarray(v, np.float32) for k, v in state.items() if k in self.state_names}


class FedAvgM(_ServerOptimizer):
    name = "fedavgm"
    Options = MomentumOptions
    state_names = ("velocity",)

    def step(self, delta: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        velocity = np.float32(self.options.momentum) * self.state_arrays["velocity"] + delta
        return np.float32(self.options.server_lr) * velocity, {"velocity": velocity}


class FedAdam(_ServerOptimizer):
    name = "fedadam"
    Options = AdaptiveOptions
    state_names = ("m", "v")

    def second_moment(self, v: np.ndarray, squared: np.ndarray) -> np.ndarray:
        b2 = np.float32(self.options.beta2)
        return b2 * v + (1 - b2) * squared

    def step(self, delta: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        o = self.options
        m = np.float32(o.beta1) * self.state_arrays["m"] + np.float32(1 - o.beta1) * delta
        v = self.second_moment(self.state_arrays["v"], delta * delta)
        return np.float32(o.server_lr) * m / (np.sqrt(v) + np.float32(o.tau)), {"m": m, "v": v}


class FedYogi(FedAdam):
    name = "fedyogi"

    def second_moment(self, v: np.ndarray, squared: np.ndarray) -> np.ndarray:
        return v - np.float32(1 - self.options.beta2) * squared * np.sign(v - squared)
