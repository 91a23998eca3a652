"""The labelled datasets a classify simulation or ``skyfed data`` can lay out, and the model made for each.

Both are generated or shipped offline: scikit-learn's bundled 8x8 digits, and MNIST-1D (``models.mnist1d``).
``load(seed)`` gives the pool the agents share and the server's evaluation set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from models.datasets import Dataset, load_digits
from models.mnist1d import load_mnist1d


@dataclass(frozen=True)
class ClassifyData:
    name: str
    model: str  # the zoo model a simulation trains on it unless told otherwise
    sample_shape: tuple[int, ...]  # per sample, as the model takes it
    load: Callable[[int], tuple[Dataset, Dataset]]  # seed -> (the agents' pool, the server's evaluation set)


DATASETS = {
    data.name: data
    for data in (
        ClassifyData("digits", "digits_cnn", (1, 8, 8), lambda seed: load_digits(test_fraction=0.2, seed=seed)),
        # one fixed dataset with its own test split: the seed partitions it (elsewhere), never redraws it
        ClassifyData("mnist1d", "mnist1d_cnn", (1, 40), lambda _seed: load_mnist1d()),
    )
}


def classify_data(name: str) -> ClassifyData:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {name!r}") from None
