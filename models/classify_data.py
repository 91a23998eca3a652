"""The labelled datasets a classify simulation or ``skyfed data`` can lay out, and the model made for each:
one plug-in each, registered below with one line (docs/architecture.md, "Plug-ins"). ``--dataset``'s and
``skyfed data``'s choices come from the registry.

Both are generated or shipped offline: scikit-learn's bundled 8x8 digits (``models.datasets``), and MNIST-1D
(``models.mnist1d``). ``load(seed)`` gives the pool the agents share and the server's evaluation set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.registry import Registry

if TYPE_CHECKING:
    from models.dataset import Dataset


@dataclass(frozen=True)
class ClassifyData:
    """One dataset, declared where it is loaded: what it is and what a model for it must take and give."""

    name: str
    model: str  # the zoo model a simulation trains on it unless told otherwise
    sample_shape: tuple[int, ...]  # per sample, as the model takes it
    load: Callable[[int], tuple[Dataset, Dataset]]  # seed -> (the agents' pool, the server's evaluation set)
    about: str  # what it is and what the server evaluates on (``skyfed data NAME --help``)
    num_classes: int = 10
    task: str = "classify"  # models.tasks' kind of model it trains


DATASETS: Registry[ClassifyData] = Registry("dataset", "--dataset")
DATASETS.add("digits", "models.datasets:DIGITS")
DATASETS.add("mnist1d", "models.mnist1d:MNIST1D")
DATASETS.add("mnist1d-large", "models.mnist1d:MNIST1D_LARGE")


def classify_data(name: str) -> ClassifyData:
    if name not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS.names())}, got {name!r}")
    return DATASETS.get(name)
