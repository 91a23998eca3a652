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

``bucket = s`` (default 1: off) first averages the updates in random groups of s [Karimireddy, He &
Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via Bucketing", ICLR 2022,
https://arxiv.org/abs/2006.09365] and clips the group means: averaging shrinks how far honest updates on
skewed data lie from each other, so clipping bites attackers more than honest outliers. The grouping is
a seeded shuffle of the round's agents (the same after a restart).

Memory: updates stay on disk and are read twice in column blocks (distances, then the sum): about
32 MB of RAM plus two model-sized vectors (the reference and the result).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from flcore.bounds import lower_median
from flcore.strategies.base import Contribution, NamedArrays, RoundResult, Strategy, column_blocks
from flcore.strategies.fedavg import WEIGHTINGS
from models.weights import RUNNING_STATISTICS, TensorRange, TensorSpec, ranges_of


@dataclass(frozen=True)
class CenteredClipOptions:
    weighting: str = "samples"
    tau_multiple: float = 1.0
    bucket: int = 1

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"strategy.weighting {self.weighting!r} must be one of {WEIGHTINGS}")
        if self.tau_multiple <= 0:
            raise ValueError(f"strategy.tau_multiple must be > 0, got {self.tau_multiple}")
        if self.bucket < 1:
            raise ValueError(f"strategy.bucket must be >= 1 (1: no bucketing), got {self.bucket}")


class CenteredClip(Strategy):
    name = "centered-clip"
    Options = CenteredClipOptions

    def __init__(self, options: CenteredClipOptions | None = None) -> None:
        super().__init__(options)
        self.reference = np.zeros(0, np.float32)
        self._change = self.reference
        self.statistics: tuple[TensorRange, ...] = ()

    def begin(self, global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:
        self.statistics = ranges_of(spec, RUNNING_STATISTICS)

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        if self.reference.size != global_vector.size:
            self.reference = np.zeros_like(global_vector, dtype=np.float32)
        weights = np.array([c.samples if self.options.weighting == "samples" else 1.0 for c in contributions])
        groups = buckets([c.agent for c in contributions], self.options.bucket)
        mixing = bucket_means(groups, weights) if self.options.bucket > 1 else None  # None: each update alone
        squared = np.zeros(len(groups))
        for start, stop, block in column_blocks(contributions):
            squared += ((grouped(mixing, block) - self.reference[start:stop]) ** 2).sum(axis=1, dtype=np.float64)
        distances = np.sqrt(squared)
        tau = self.options.tau_multiple * lower_median(distances)
        with np.errstate(divide="ignore", invalid="ignore"):
            clip = np.where(distances > tau, tau / distances, 1.0)
        group_weights = np.array([weights[g].sum() for g in groups])
        coefficients = (group_weights * clip / group_weights.sum()).astype(np.float32)[:, None]
        change = self._change = self.reference.copy()
        for start, stop, block in column_blocks(contributions):
            change[start:stop] += (coefficients * (grouped(mixing, block) - self.reference[start:stop])).sum(axis=0)
        clipped = sorted(contributions[i].agent for g, k in zip(groups, clip, strict=True) if k < 1 for i in g)
        return RoundResult(global_vector + change, {"tau": float(tau), "centered_clipped": clipped})

    def follow(self, change: np.ndarray) -> None:
        """Take ``change`` (the step another aggregation made this round) as the round's change, so the next
        reference is where training went whichever aggregation stepped (``strategies.auto``)."""
        self._change = change

    def on_commit(self, result: RoundResult) -> None:
        self.reference = self._change
        for r in self.statistics:
            self.reference[r.start : r.stop] = 0

    def state(self) -> NamedArrays:
        return {"reference": self.reference}

    def restore(self, state: NamedArrays) -> None:
        self.reference = np.asarray(state.get("reference", np.zeros(0, np.float32)), np.float32)


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
