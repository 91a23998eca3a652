"""A dataset's mini-batches without ``DataLoader``: the same tensors in the same order, by slicing.

``DataLoader`` over a ``TensorDataset`` indexes every sample in Python and stacks them again. For the small
models trained here that per-sample work and the loader's set-up cost more than the model: in a host of 100
agents (each about 11 samples a round, plus two evaluations of its test split) and in the server's scoring of
trained models on its 360-sample test set (py-spy), the loader was a tenth of the time.

``Batches`` draws from its seeded generator exactly as ``DataLoader(shuffle=True, generator=…)`` does for each
pass (the worker base seed as the pass starts, the permutation, and the sampler's second, empty permutation as
it runs out), so a seeded training sees ``DataLoader``'s batches (``tests/test_batches.py`` holds the two to each
other). DP-SGD keeps ``DataLoader`` (``models.datasets.to_loader``): Opacus replaces its sampler.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from models.dataset import Dataset


class Batches:
    """``(x, y)`` tensor batches of ``data``, shuffled each pass when ``shuffle``, the last one short."""

    def __init__(self, data: Dataset, *, batch_size: int, shuffle: bool, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x = torch.from_numpy(data.x)
        self.y = torch.from_numpy(data.y)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(len(self.y) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # DataLoader's worker base seed
        n, size = len(self.y), self.batch_size
        if not self.shuffle:
            for start in range(0, n, size):
                yield self.x[start : start + size], self.y[start : start + size]
            return
        order = torch.randperm(n, generator=self.generator)
        for start in range(0, n, size):
            chosen = order[start : start + size]
            if len(chosen) < size:  # the sampler ran out to fill this short batch: its remainder permutation
                torch.randperm(n, generator=self.generator)
            yield self.x[chosen], self.y[chosen]
        if n % size == 0:  # ... or when asked for a batch after the last full one
            torch.randperm(n, generator=self.generator)
