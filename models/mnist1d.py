"""MNIST-1D (Greydanus 2020, arXiv:2011.14439): the ten digits as 1-D signals of 40 samples, generated here.

The ``mnist1d`` package's ``get_dataset`` downloads a pickle by default; SkyFed never calls it. It calls the
package's generator, ``make_dataset``, with the package's default arguments (5,000 signals, seed 42, the
first 80 % for training): the same data on every machine, offline, in about a second. The generator seeds
NumPy's and Python's global random state; that state is put back afterwards, so a simulation that
generates MNIST-1D draws the same random numbers elsewhere as one that does not.
"""

from __future__ import annotations

import random
from functools import lru_cache

import numpy as np

from models.datasets import Dataset

SIGNAL_LENGTH = 40  # get_dataset_args().final_seq_length


@lru_cache(maxsize=1)
def load_mnist1d() -> tuple[Dataset, Dataset]:
    """MNIST-1D's own split: 4,000 training and 1,000 test signals, ``x`` of shape (N, 1, 40)."""
    from mnist1d.data import get_dataset_args, make_dataset

    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        raw = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    train, test = (_frozen(raw[x_key], raw[y_key]) for x_key, y_key in (("x", "y"), ("x_test", "y_test")))
    return train, test


def _frozen(x: np.ndarray, y: np.ndarray) -> Dataset:
    """A read-only ``Dataset`` (the cached copy is shared by every caller)."""
    data = Dataset(x.astype(np.float32)[:, None, :], y.astype(np.int64))
    data.x.setflags(write=False)
    data.y.setflags(write=False)
    return data
