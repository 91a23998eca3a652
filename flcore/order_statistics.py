"""Exact order statistics of every column of a block of updates: the coordinate-wise median and trimmed mean.

A column holds one coordinate of the round's n updates: it is short (n agents) and there are millions of
them, so sorting column by column (``np.median``, ``np.partition`` along the updates) spends its time on
per-column overhead — measured at 30–60x a copy of the same bytes on 20 updates. A sorting network sorts
every column of a block at once: Batcher's odd-even merge sort [K. E. Batcher, "Sorting networks and their
applications", AFIPS 1968] is a fixed list of n·log²n/4 compare-exchanges, each a vectorised
``minimum``/``maximum`` of two whole rows, over blocks that stay in the CPU's cache. Min and max are exact,
so the sorted rows — and the median and trimmed mean taken from them as ``np.median`` and a sorted mean
take them — are bit-identical to NumPy's. Past ``NETWORK_MAX`` updates the network's length grows faster
than the data and ``np.partition`` over the transposed block is used instead (same values).
"""

from __future__ import annotations

import functools

import numpy as np

NETWORK_MAX = 256  # updates: beyond, the network's log² n passes cost more than partitioning each column


@functools.cache
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort on ``n`` wires as compare-exchanges ``(i, j)``, ``i < j``: after them wire
    i holds the i-th smallest value. Built for the next power of two; a comparator that touches a wire past
    ``n`` would meet a +inf pad and move nothing, so it is left out."""
    size = 1 << max(n - 1, 0).bit_length()
    pairs = []
    merge = 1
    while merge < size:
        step = merge
        while step >= 1:
            for first in range(step % merge, size - step, 2 * step):
                for i in range(min(step, size - first - step)):
                    low, high = first + i, first + i + step
                    if low // (2 * merge) == high // (2 * merge) and high < n:
                        pairs.append((low, high))
            step //= 2
        merge *= 2
    return tuple(pairs)


def sorted_rows(block: np.ndarray) -> list[np.ndarray]:
    """Each column of ``block`` (updates x columns, float32) sorted: row i of the result is every column's
    i-th smallest value. ``block`` is overwritten: the rows are its own, and one more."""
    n = len(block)
    if n > NETWORK_MAX:
        return list(np.sort(block.T, axis=1).T)
    wires, free = list(block), np.empty_like(block[0])
    for low, high in sorting_network(n):
        a, b = wires[low], wires[high]
        np.minimum(a, b, out=free)
        np.maximum(a, b, out=b)
        wires[low], free = free, a
    return wires


def column_median(block: np.ndarray, out: np.ndarray) -> None:
    """``out`` = each column's median, as ``np.median(block, axis=0)`` computes it (the mean of the two middle
    values for an even count). ``block`` is overwritten."""
    n = len(block)
    if n > NETWORK_MAX:
        middle = np.partition(block.T, ((n - 1) // 2, n // 2), axis=1).T
    else:
        middle = sorted_rows(block)
    if n % 2:
        np.copyto(out, middle[n // 2])
    else:
        np.add(middle[n // 2 - 1], middle[n // 2], out=out)
        out *= np.float32(0.5)  # exact, as np.median's division by 2


def column_trimmed_mean(block: np.ndarray, trim: int, out: np.ndarray) -> None:
    """``out`` = each column's mean after dropping its ``trim`` smallest and ``trim`` largest values, summed in
    ascending order in float32 (as ``np.sort(block, axis=0)[trim:n - trim].mean(axis=0, dtype=float32)`` does
    for a block wider than one column).
    ``block`` is overwritten."""
    rows = sorted_rows(block)[trim : len(block) - trim]
    np.copyto(out, rows[0])
    for row in rows[1:]:
        out += row
    out /= np.float32(len(rows))
