"""Check an update's values, measure its norm and fold it into a running sum in one pass over memory.

The delta is walked in blocks of 1 MiB. For each block one BLAS dot product gives its sum of squares
(NaN or Inf anywhere makes it non-finite), and while the running norm stays within ``Fold.max_norm``
one BLAS saxpy folds the block into the accumulator while it is still in cache. So each update is read
from main memory once (``make bench``: the accept path at about the cost of copying the bytes).
A fold is never left half done: if the update turns out non-finite or larger than ``max_norm``, the
blocks already folded are subtracted again, in the same blocks (they are bounded by ``max_norm``,
so nothing large is cancelled), and the caller gets ``folded=False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flcore import blas

BLOCK = 1 << 18  # float32 values per block: 1 MiB, which stays in L2 between the dot and the saxpy


class NonFiniteUpdate(ValueError):
    """The delta holds NaN/Inf, or values so large that their squares overflow float32."""


@dataclass(frozen=True)
class Fold:
    """Fold ``weight * delta`` into ``into`` (in place) unless the delta's L2 norm exceeds ``max_norm``."""

    into: np.ndarray
    weight: float
    max_norm: float


@dataclass(frozen=True)
class Scan:
    norm: float
    folded: bool


def axpy(x: np.ndarray, y: np.ndarray, a: float) -> None:
    """y += a * x in place (float32 BLAS saxpy)."""
    out = blas.saxpy(x, y, a=a)
    if not np.shares_memory(out, y):  # pragma: no cover - scipy documents in-place for contiguous float32
        raise RuntimeError("saxpy did not update the accumulator in place")


def _undo(delta: np.ndarray, fold: Fold, upto: int) -> None:
    for start in range(0, upto, BLOCK):
        stop = min(start + BLOCK, upto)
        axpy(delta[start:stop], fold.into[start:stop], -fold.weight)


def scan(delta: np.ndarray, fold: Fold | None = None) -> Scan:
    """The delta's L2 norm, after checking every value is finite; fold it on the way when ``fold`` allows.

    Raises ``NonFiniteUpdate`` (with nothing folded) for NaN/Inf values or a float32 overflow.
    """
    squares = 0.0
    folded_upto = 0
    folding = fold is not None and fold.weight != 0 and fold.max_norm > 0
    for start in range(0, delta.size, BLOCK):
        stop = min(start + BLOCK, delta.size)
        block = delta[start:stop]
        block_squares = float(blas.sdot(block, block))
        if not math.isfinite(block_squares):
            if fold is not None:
                _undo(delta, fold, folded_upto)
            if np.isfinite(block).all():
                raise NonFiniteUpdate("values so large that the norm overflows float32")
            raise NonFiniteUpdate("NaN or Inf in the delta")
        squares += block_squares
        if folding:
            assert fold is not None
            if math.sqrt(squares) > fold.max_norm:
                _undo(delta, fold, folded_upto)
                folding, folded_upto = False, 0
            else:
                axpy(block, fold.into[start:stop], fold.weight)
                folded_upto = stop
    return Scan(norm=math.sqrt(squares), folded=folding)
