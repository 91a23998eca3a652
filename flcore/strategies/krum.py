"""Multi-Krum [Blanchard et al., 2017]. Paper: https://arxiv.org/abs/1703.02757

Krum scores each update by the sum of squared distances to its n - f - 2 nearest other updates, where
f is the number of Byzantine agents to tolerate; Multi-Krum averages the ``keep`` best-scored updates
(default n - f; El Mhamdi et al., 2018, arXiv:1802.07927). Distances are taken between the clipped
deltas. The guarantee needs n ≥ 2f + 3; with fewer updates f is lowered to (n - 3) // 2 for that round
and the metrics say so (``f_used``). The kept agents are listed in ``metrics.aggregation.selected``.
Under differential privacy the noise is calibrated to Multi-Krum's sensitivity (``flcore.dp_sensitivity``).

Memory: updates stay on disk and are read twice (in cache-sized column blocks for the n x n Gram matrix,
then the kept ones added one by one): a few MB of RAM plus 8·n² bytes and the result.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from flcore import blas
from flcore.dp_sensitivity import multi_krum_sensitivity
from flcore.strategies.base import Contribution, RoundResult, Strategy, column_blocks, weighted_sum
from flcore.strategies.choice import krum_f_used


@dataclass(frozen=True)
class KrumOptions:
    f: int = 2  # 2 of 10 attackers: docs/results/robustness.md
    keep: int = 0  # 0: n - f

    def __post_init__(self) -> None:
        if self.f < 0:
            raise ValueError(f"strategy.f must be >= 0 (Byzantine agents to tolerate), got {self.f}")
        if self.keep < 0:
            raise ValueError(f"strategy.keep must be >= 0 (0 = n - f), got {self.keep}")


def krum_scores(squared_distances: np.ndarray, f: int) -> np.ndarray:
    """Per update, the sum of its n - f - 2 smallest squared distances to the others."""
    n = len(squared_distances)
    neighbours = max(n - f - 2, 1)
    others = np.sort(squared_distances + np.diag(np.full(n, np.inf)), axis=1)[:, : min(neighbours, n - 1)]
    return others.sum(axis=1)


def gram_matrix(
    contributions: list[Contribution], *, center: np.ndarray | None = None, means: np.ndarray | None = None
) -> np.ndarray:
    """The n x n inner products of the clipped deltas (of ``delta − center`` when given), one pass over the
    updates in column blocks shared among the cores (``blas.in_parallel``: NumPy's products let the other
    threads run, SciPy's ``ssyrk`` would not); ``means``, when given, receives the deltas' mean from the same
    pass (float32, within its rounding of a sum in order). Each block is shifted by its own mean m before its float32
    product (summed in float64 across blocks), and m's part added back: xᵢ·xⱼ = cᵢ·cⱼ + cᵢ·m + cⱼ·m + m·m with
    cᵢ = xᵢ − m. The float32 rounding is then relative to how far the updates lie from their mean, not to their
    norms, so distances between updates that nearly agree keep float64's choices at a fraction of its time; the
    mean, unlike any one update, is not an attacker's to place (one of n moves it by 1/n of its distance). A
    block whose float32 product overflows (values near float32's range) is redone in float64."""
    n = len(contributions)
    sums = [(np.zeros((n, n)), np.zeros(n), np.zeros(1)) for _ in range(blas.PARTS)]  # centred, cross, m·m

    def add_blocks(part: int, parts: int) -> None:
        centred, cross, mean_square = sums[part]
        average = np.full(n, 1 / n, np.float32)
        for start, stop, block in column_blocks(contributions, part, parts):
            if center is not None:
                block -= center[start:stop]
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught below and redone
                mean = average @ block  # one BLAS pass (np.mean takes two)
                block -= mean
                product = block @ block.T
            if np.isfinite(product).all() and np.isfinite(mean).all():
                centred += product
                cross += block @ mean
                mean_square += float(mean @ mean)
            else:
                wide = np.stack([np.asarray(c.delta[start:stop], np.float64) * c.scale for c in contributions])
                if center is not None:
                    wide -= center[start:stop]
                centred += wide @ wide.T
                mean = wide.mean(axis=0)
            if means is not None:
                np.add(mean, 0 if center is None else center[start:stop], out=means[start:stop], casting="unsafe")

    blas.in_parallel(add_blocks)
    centred, cross, mean_square = (sum(parts) for parts in zip(*sums, strict=True))
    centred = np.triu(centred) + np.triu(centred, 1).T  # exactly symmetric
    return centred + cross[:, None] + cross[None, :] + float(mean_square[0])


def mean_and_gram(
    global_vector: np.ndarray, contributions: list[Contribution], center: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The kept models' (``Contribution.model``) mean and the Gram matrix of ``model − center`` (of the models
    themselves without one), from one pass over them (``gram_matrix(..., means=)``): the personalized strategies
    publish the one and cluster or attend on the other."""
    models = [replace(c, delta=c.model, scale=1.0) for c in contributions]
    mean = np.empty(global_vector.size, np.float32)
    return mean, gram_matrix(models, center=center, means=mean)


def squared_distances(gram: np.ndarray) -> np.ndarray:
    diag = np.diag(gram)
    return np.maximum(diag[:, None] + diag[None, :] - 2 * gram, 0.0)


class MultiKrum(Strategy):
    name = "krum"
    Options = KrumOptions
    bounded_by_clip = True

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        return self.aggregate_with(global_vector, contributions, gram_matrix(contributions))

    def kept(self, updates: int) -> int:
        """How many of ``updates`` best-scored updates are averaged."""
        return min(self.options.keep or updates - krum_f_used(self.options.f, updates), updates)

    def dp_sensitivity(self, updates: int, clip: float) -> float:
        return multi_krum_sensitivity(updates, self.kept(updates), clip)

    def aggregate_with(
        self, global_vector: np.ndarray, contributions: list[Contribution], gram: np.ndarray
    ) -> RoundResult:
        """``aggregate`` given the clipped updates' ``gram_matrix`` (a caller that has it saves a pass)."""
        n = len(contributions)
        f = krum_f_used(self.options.f, n)
        scores = krum_scores(squared_distances(gram), f)
        keep = self.kept(n)
        chosen = np.sort(np.argsort(scores, kind="stable")[:keep])
        weights = np.zeros(n, np.float32)
        weights[chosen] = 1 / keep
        new = global_vector + weighted_sum(contributions, weights)
        selected = [contributions[i].agent for i in chosen]
        return RoundResult(new, {"selected": selected, "f_used": f})
