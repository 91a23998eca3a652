"""Models mixed from the kept ones: ``Σⱼ mixing[r, j]·modelⱼ`` for every row r, a group's model (DemLearn) or an
agent's cloud model (FedAMP), read from the server's model store in column blocks, the blocks shared among the
cores (``blas.in_parallel``).

``mixed_models`` computes the rows a batch at a time, one pass over the models per batch, so RAM holds
``MIX_BYTES`` of results whatever the number of rows (100 agents × a 3.2M-value model would be 1.3 GB at once).
``keep_mixed`` keeps every row as a new model without holding it: ``ROWS_AT_ONCE`` rows in one pass, computed a
column chunk at a time and handed chunk by chunk to each row's ``ModelWriter``, which hashes (where it is
fingerprinted) and writes it while the next chunk is mixed. At 100 agents × 3.2M values that is one pass over the
1.28 GB of kept models instead of five, and no model read back to be fingerprinted (docs/architecture.md, "The
server's files").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace

import numpy as np

from flcore import blas
from flcore.agent_models import Holding, ModelWriter
from flcore.strategies.base import Contribution, column_blocks

MIX_BYTES = 256 << 20  # RAM for the models mixed in one pass over the kept ones
ROWS_AT_ONCE = 128  # models kept in one pass over the kept ones, each with a file open meanwhile
CHUNK = 1 << 17  # values of each row mixed before they are written: 512 KB a write and a hash update
EMIT_THREADS = 2  # hashing and writing one chunk while the kernel threads mix the next
SMALLEST_NORMAL = np.finfo(np.float32).tiny


def float32_weights(mixing: np.ndarray) -> np.ndarray:
    """``mixing`` in float32 for the kernels, a weight below float32's smallest normal number (1.2e-38) set to 0.

    Such a subnormal weight (FedAMP's e^(−d²/σ) for d²/σ between about 87 and 103) sends x86 cores down their
    slow path in every product it enters: measured on the development VM, a (100 x 100) @ (100 x 3932) mix
    with subnormal weights in half its columns took 46 ms instead of 0.8 ms, and FedAMP's end of round at 100
    agents 49.5 s instead of 2 s. Its share of a model is far below the rounding of the sum it joins, whose
    weights add up to 1."""
    weights = mixing.astype(np.float32)
    weights[np.abs(weights) < SMALLEST_NORMAL] = 0
    return weights


def mixed_batches(views: list[Contribution], mixing: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(first, rows)`` where ``rows[i]`` is ``Σⱼ mixing[first + i, j]·modelⱼ`` (float32) and ``views[j].delta``
    is model j; ``rows`` are valid until the next batch is asked for."""
    size = views[0].delta.size
    batch = max(1, MIX_BYTES // (4 * size))
    buffer = np.empty((min(batch, len(mixing)), size), np.float32)  # one, reused: a batch's rows, then the next's
    for first in range(0, len(mixing), batch):
        weights = float32_weights(mixing[first : first + batch])
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
    writer: Callable[[str], ModelWriter], names: list[str], views: list[Contribution], mixing: np.ndarray
) -> list[Holding]:
    """Keep ``Σⱼ mixing[r, j]·modelⱼ`` as the new model ``writer(names[r])`` for every row r, in row order."""
    kept: list[Holding] = []
    with ThreadPoolExecutor(EMIT_THREADS, thread_name_prefix="keep") as pool:
        for first in range(0, len(mixing), ROWS_AT_ONCE):
            writers: list[ModelWriter] = []
            pending: list[Future] = []
            try:
                for name in names[first : first + ROWS_AT_ONCE]:
                    writers.append(writer(name))
                for rows in mixed_chunks(views, mixing[first : first + ROWS_AT_ONCE]):  # the next chunk is mixed
                    for done in pending:  # while this loop's writes run; once they are done, their buffer is
                        done.result()  # the next chunk's
                    pending = [pool.submit(w.write, row) for w, row in zip(writers, rows, strict=True)]
                for done in pending:
                    done.result()
                pending = [pool.submit(w.close) for w in writers]
                kept += [done.result() for done in pending]
            except BaseException:
                wait(pending)  # no write or close may still use a descriptor a discard closes
                for w in writers:
                    w.discard()
                raise
    return kept


def mixed_chunks(views: list[Contribution], mixing: np.ndarray) -> Iterator[np.ndarray]:
    """``rows`` where ``rows[r]`` is the next ``CHUNK`` values of ``Σⱼ mixing[r, j]·modelⱼ`` (float32), chunk
    after chunk; ``rows`` stay valid until the next but one chunk is asked for."""
    size, weights = views[0].delta.size, float32_weights(mixing)
    buffers = [np.empty((len(weights), min(CHUNK, size)), np.float32) for _ in range(2)]
    for number, start in enumerate(range(0, size, CHUNK)):
        stop = min(start + CHUNK, size)
        out, chunk = buffers[number % 2][:, : stop - start], [replace(v, delta=v.delta[start:stop]) for v in views]

        def mix(part: int, parts: int, out: np.ndarray = out, chunk: list[Contribution] = chunk) -> None:
            for first, last, block in column_blocks(chunk, part, parts):
                np.matmul(weights, block, out=out[:, first:last])

        blas.in_parallel(mix)
        yield out
