"""Centered clipping [Karimireddy, He & Jaggi, 2021]. Paper: https://arxiv.org/abs/2012.10333

"Learning from History for Byzantine Robust Optimization" (ICML 2021) clips each update *around a
reference* instead of around zero: new = v + Σ wᵢ·cᵢ·(xᵢ − v) / Σ wᵢ with cᵢ = min(1, τ / ‖xᵢ − v‖).
An update that points away from where training has been going (a sign flip) is far from v and counts
for at most τ, while every update still contributes — nothing is dropped, unlike Krum.

Choices where the paper leaves room: the reference v is the previous round's global change (the
paper uses the server's momentum; ours is kept in the checkpoint as cross-round state, and is zero in
the first round, where this reduces to plain clipping); τ is ``tau_multiple`` x the lower median of the
round's distances ‖xᵢ − v‖ (the paper's τ is a tuned constant; a median follows the scale of training
and is bounded by an honest distance under an honest majority); one clipping iteration (the paper shows
one suffices with momentum); weights wᵢ as FedAvg's (capped samples, or uniform). BatchNorm running
statistics get no reference (v = 0 there): they are averages, not gradients, and extrapolating last
round's drop of a running variance can make it negative — measured, it rolled back 17 of 20 rounds.
With v = 0 their result is a shrunk weighted mean of valid values, so it stays valid.

The reference is the step the round *committed* (after ``flcore.change_bound`` shortened it, say), and it
is used at most as long as the lower median of the round's clipped update norms: new = Σ wᵢ(cᵢxᵢ + (1 −
cᵢ)v) is a convex combination of the clipped updates and v, so a reference longer than honest updates
would carry last round's step into this one whatever they say. One participant that steers a step
therefore cannot walk the reference away with it (docs/results/robustness.md, a rogue of three).

``center = "median"`` centres on the round's coordinate-wise median instead of last round's step. With
few updates one participant is a third of the round, and clipped around last round's step its reversed
update still cancels most of two honest ones (measured: a rogue of three sending x -20 held the model at
0.17 accuracy against 0.997 clean); the median of three or more lies within the honest values in every
coordinate while honest participants are a majority, and with nothing clipped the result is still the
weighted mean (new = m + Σ wᵢ(xᵢ − m)). ``auto`` uses it for rounds too small for Krum.

``bucket = s`` (default 1: off) first averages the updates in random groups of s [Karimireddy, He &
Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via Bucketing", ICLR 2022,
https://arxiv.org/abs/2006.09365] and clips the group means: averaging shrinks how far honest updates on
skewed data lie from each other, so clipping bites attackers more than honest outliers. The grouping is
a seeded shuffle of the round's agents (the same after a restart).

Memory: updates stay on disk and are read twice in cache-sized column blocks (distances, then the sum):
a few MB of RAM plus two model-sized vectors (the reference and the result).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from flcore.bounds import lower_median
from flcore.order_statistics import column_median
from flcore.strategies.base import (
    Contribution,
    NamedArrays,
    RoundResult,
    Strategy,
    column_blocks,
    column_rows,
    weighted_sum,
)
from flcore.strategies.fedavg import WEIGHTINGS
from models.weights import RUNNING_STATISTICS, TensorRange, TensorSpec, ranges_of

CENTERS = ("last-step", "median")


@dataclass(frozen=True)
class CenteredClipOptions:
    weighting: str = "samples"
    tau_multiple: float = 1.0
    bucket: int = 1
    center: str = "last-step"

    def __post_init__(self) -> None:
        if self.center not in CENTERS:
            raise ValueError(f"strategy.center must be one of {', '.join(CENTERS)}, got {self.center!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"strategy.weighting {self.weighting!r} must be one of {WEIGHTINGS}")
        if self.tau_multiple <= 0:
            raise ValueError(f"strategy.tau_multiple must be > 0, got {self.tau_multiple}")
        if self.bucket < 1:
            raise ValueError(f"strategy.bucket must be >= 1 (1: no bucketing), got {self.bucket}")


class CenteredClip(Strategy):
    name = "centered-clip"
    Options = CenteredClipOptions
    why_not_private = (
        "it clips around last round's (noisy) change with a radius taken from the un-noised distances, so one agent "
        "moves every other update's weight, and the only bound, 2·(S + the reference's norm), grows with the noise "
        "itself"
    )

    def __init__(self, options: CenteredClipOptions | None = None) -> None:
        super().__init__(options)
        self.reference = np.zeros(0, np.float32)
        self._base = self.reference  # the model the round steps from
        self.statistics: tuple[TensorRange, ...] = ()

    def begin(self, global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:
        self.statistics = ranges_of(spec, RUNNING_STATISTICS)

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        return self.aggregate_around(global_vector, contributions, self.options.center)

    def aggregate_around(self, global_vector: np.ndarray, contributions: list[Contribution],
                         center: str) -> RoundResult:  # fmt: skip
        """The round clipped around ``center``: last round's step (bounded) or the round's median."""
        if self.reference.size != global_vector.size:
            self.reference = np.zeros_like(global_vector, dtype=np.float32)
        self._base = global_vector
        weights = np.array([c.samples if self.options.weighting == "samples" else 1.0 for c in contributions])
        groups = buckets([c.agent for c in contributions], self.options.bucket)
        mixing = bucket_means(groups, weights) if self.options.bucket > 1 else None  # None: each update alone
        if center == "median":
            reference, shrunk = median_of(contributions, mixing), 1.0
        else:
            reference, shrunk = bounded_reference(self.reference, contributions)
        squared = np.zeros(len(groups))
        for start, stop, block in column_blocks(contributions):
            values = grouped(mixing, block)
            values -= reference[start:stop]
            squared += np.einsum("ij,ij->i", values, values)
        distances = np.sqrt(squared)
        tau = self.options.tau_multiple * lower_median(distances)
        with np.errstate(divide="ignore", invalid="ignore"):
            clip = np.where(distances > tau, tau / distances, 1.0)
        group_weights = np.array([weights[g].sum() for g in groups])
        coefficients = group_weights * clip / group_weights.sum()
        # v + Σ cᵢ(xᵢ − v) = Σ cᵢxᵢ + (1 − Σ cᵢ)·v: one weighted sum of the updates as they are stored
        change = weighted_sum(contributions, coefficients if mixing is None else coefficients @ mixing)
        change += np.float32(1 - coefficients.sum()) * reference
        clipped = sorted(contributions[i].agent for g, k in zip(groups, clip, strict=True) if k < 1 for i in g)
        detail = {"tau": float(tau), "centered_clipped": clipped, "center": center,
                  **({"reference_shrunk": shrunk} if shrunk < 1 else {})}  # fmt: skip
        return RoundResult(global_vector + change, detail)

    def follow(self, base: np.ndarray) -> None:
        """The model this round steps from when another aggregation makes the step (``strategies.auto``): the
        next reference is the committed step whichever aggregation made it."""
        self._base = base

    def on_commit(self, result: RoundResult) -> None:
        if self._base.size != result.global_vector.size:  # no round stepped from a model this strategy saw
            return
        self.reference = (result.global_vector - self._base).astype(np.float32, copy=False)
        for r in self.statistics:
            self.reference[r.start : r.stop] = 0

    def state(self) -> NamedArrays:
        return {"reference": self.reference}

    def restore(self, state: NamedArrays) -> None:
        self.reference = np.asarray(state.get("reference", np.zeros(0, np.float32)), np.float32)


def bounded_reference(reference: np.ndarray, contributions: list[Contribution]) -> tuple[np.ndarray, float]:
    """``(reference, factor)``: the reference shortened (``factor`` < 1) to the lower median of the round's
    clipped update norms when it is longer."""
    norm = float(np.sqrt(np.dot(reference, reference))) if reference.size else 0.0
    honest = lower_median(np.array([c.norm * c.scale for c in contributions])) if contributions else 0.0
    if norm <= honest or norm == 0:
        return reference, 1.0
    factor = honest / norm
    return reference * np.float32(factor), round(factor, 6)


def median_of(contributions: list[Contribution], mixing: np.ndarray | None) -> np.ndarray:
    """The coordinate-wise median of the round's clipped updates (or of their bucket means)."""
    out = np.empty(contributions[0].delta.size, np.float32)
    if mixing is None:
        for start, stop, rows in column_rows(contributions):
            column_median(rows, out[start:stop])
    else:
        for start, stop, block in column_blocks(contributions):
            column_median(mixing @ block, out[start:stop])
    return out


def buckets(agents: list[str], size: int) -> list[list[int]]:
    """Indices of ``agents`` in groups of ``size`` (the last may be smaller), shuffled by a seed drawn from
    the round's agent names, so the same round groups the same way after a restart."""
    order = list(range(len(agents)))
    if size > 1:
        seed = zlib.crc32("\n".join(sorted(agents)).encode())
        np.random.default_rng(seed).shuffle(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def bucket_means(groups: list[list[int]], weights: np.ndarray) -> np.ndarray:
    """The (groups x updates) matrix whose rows average each group's updates by their weights."""
    mixing = np.zeros((len(groups), len(weights)), np.float32)
    for row, members in enumerate(groups):
        mixing[row, members] = weights[members] / weights[members].sum()
    return mixing


def grouped(mixing: np.ndarray | None, block: np.ndarray) -> np.ndarray:
    """A column block of the updates as clipped: their group means, or the updates themselves (no bucketing:
    no matrix product on the default path)."""
    return block if mixing is None else mixing @ block
