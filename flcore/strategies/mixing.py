"""Models mixed from the kept ones: ``Σⱼ mixing[r, j]·modelⱼ`` for every row r, a group's model (DemLearn) or an
agent's cloud model (FedAMP), read from the server's model store in column blocks.

Rows are computed a batch at a time, one pass over the models per batch, so RAM holds ``MIX_BYTES`` of results
whatever the number of rows (100 agents × a 3.2M-value model would be 1.3 GB at once), the column blocks shared
among the cores (``blas.in_parallel``). ``keep_mixed`` keeps every row as a new model: each batch's rows are
fingerprinted and written ``KEEP_THREADS`` at a time (SHA-256 and the writes let other threads run), so one
model's hashing overlaps another's write and their fsyncs wait together; the next batch is mixed once the batch's
rows are kept, so the results never take more than ``MIX_BYTES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from flcore import blas
from flcore.agent_models import Holding
from flcore.strategies.base import Contribution, column_blocks

MIX_BYTES = 256 << 20  # RAM for the models mixed in one pass over the kept ones
KEEP_THREADS = 4  # hashing takes the cores while the other writes' fsyncs wait for the disk


def mixed_batches(views: list[Contribution], mixing: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(first, rows)`` where ``rows[i]`` is ``Σⱼ mixing[first + i, j]·modelⱼ`` (float32) and ``views[j].delta``
    is model j; ``rows`` are valid until the next batch is asked for."""
    size = views[0].delta.size
    batch = max(1, MIX_BYTES // (4 * size))
    buffer = np.empty((min(batch, len(mixing)), size), np.float32)  # one, reused: a batch's rows, then the next's
    for first in range(0, len(mixing), batch):
        weights = mixing[first : first + batch].astype(np.float32)
        out = buffer[: len(weights)]

        def mix(part: int, parts: int, weights: np.ndarray = weights, out: np.ndarray = out) -> None:
            for start, stop, block in column_blocks(views, part, parts):
                np.matmul(weights, block, out=out[:, start:stop])

        blas.in_parallel(mix)
        yield first, out


def mixed_models(views: list[Contribution], mixing: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(r, Σⱼ mixing[r, j]·modelⱼ)`` for every row r; each row is valid until the next batch is asked for."""
    for first, rows in mixed_batches(views, mixing):
        for i, row in enumerate(rows):
            yield first + i, row


def keep_mixed(
    put: Callable[[str, np.ndarray], Holding], names: list[str], views: list[Contribution], mixing: np.ndarray
) -> list[Holding]:
    """``put(names[r], Σⱼ mixing[r, j]·modelⱼ)`` for every row r (``KeptModels.put``, called ``KEEP_THREADS``
    at a time), in row order."""
    kept: list[Holding] = []
    with ThreadPoolExecutor(KEEP_THREADS, thread_name_prefix="keep") as pool:
        for first, rows in mixed_batches(views, mixing):
            kept += pool.map(put, names[first : first + len(rows)], rows)  # all kept before the buffer is reused
    return kept
