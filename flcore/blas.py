"""SciPy's BLAS routines (``sdot``, ``saxpy``, ``ssyrk``, …), imported on first use, and ``one_thread`` for the
column-block kernels.

Importing SciPy takes about a second, which a config check that builds a strategy to validate its options
(``skyfed server check``) must not pay: use ``blas.sdot(x, y)``; after the first call the routine is a plain
module attribute. The kernels' products are small (an n x n Gram matrix, a few rows over a cache-sized
block), and OpenBLAS's worker threads spin on them when the cores are busy: measured on the 2-core
development VM with tests running beside it, a (20 x 100) @ (100 x 4096) product took 15 ms on OpenBLAS's
threads against 0.9 ms on one (threadpoolctl sets the count). ``in_parallel`` spreads a kernel's column
blocks over the cores instead, one BLAS thread each, for kernels whose calls release the GIL (NumPy's
``matmul`` does; SciPy's f2py wrappers hold it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

PARTS = 2  # how ``in_parallel`` splits a kernel whatever the cores, so its sums add up in the same order anywhere;
# each part holds its own sums (8 MB for a Gram matrix of 1,000 updates) and column block (16 MB at 1,000)


def __getattr__(name: str) -> Any:  # noqa: ANN401 - a BLAS routine
    from scipy.linalg import blas

    routine = getattr(blas, name)
    globals()[name] = routine
    return routine


@functools.cache
def _controller() -> Any:  # noqa: ANN401 - threadpoolctl.ThreadpoolController
    import scipy.linalg.blas  # noqa: F401 - SciPy's OpenBLAS loaded first, so it is controlled too
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


@contextmanager
def one_thread() -> Iterator[None]:
    """NumPy's and SciPy's BLAS on the calling thread alone while the block runs."""
    with _controller().limit(limits=1, user_api="blas"):
        yield


@functools.cache
def threads() -> int:
    """The kernels' threads: the cores this process may run on, at most one per part."""
    return min(PARTS, len(os.sched_getaffinity(0)))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads(), thread_name_prefix="kernel")


def in_parallel(work: Callable[[int, int], None]) -> None:
    """``work(part, PARTS)`` for every part, spread over ``threads()`` threads, one BLAS thread apiece; the
    first error is raised once all have ended. The parts are the same on every machine, so a kernel that
    keeps one output per part, or writes disjoint ones, gives the same bits on one core as on four."""
    with one_thread():
        futures = [_pool().submit(work, part, PARTS) for part in range(PARTS)]
        for future in futures:
            future.exception()
        for future in futures:
            future.result()
