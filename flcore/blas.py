"""SciPy's BLAS routines (``sdot``, ``saxpy``, ``ssyrk``, …), imported on first use, and ``one_thread`` for the
column-block kernels.

Importing SciPy takes about a second, which a config check that builds a strategy to validate its options
(``skyfed server check``) must not pay: use ``blas.sdot(x, y)``; after the first call the routine is a plain
module attribute. The kernels' products are small (an n x n Gram matrix, a few rows over a cache-sized
block), and OpenBLAS's worker threads spin on them when the cores are busy: measured on the 2-core
development VM with tests running beside it, a (20 x 100) @ (100 x 4096) product took 15 ms on OpenBLAS's
threads against 0.9 ms on one (threadpoolctl sets the count).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


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
