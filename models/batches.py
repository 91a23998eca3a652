"""A dataset's mini-batches without ``DataLoader``: the same tensors in the same order, by slicing.

``DataLoader`` over a ``TensorDataset`` indexes every sample in Python and stacks them again: 1.2 ms of the
server's 9 ms scoring of a trained digits CNN on its 360-sample test set (slicing: 0.01 ms), and 0.1 ms of set-up
per pass, three passes a round, for an agent of a hosted 100 whose round trains on about 11 samples.

``Batches`` draws from its seeded generator exactly as ``DataLoader(shuffle=True, generator=…)`` does for each
pass (the worker base seed as the pass starts, the permutation, and the sampler's second one, of which it takes
nothing, as it runs out), so a seeded training sees ``DataLoader``'s batches (``tests/test_batches.py`` holds
the two to each other). DP-SGD keeps ``DataLoader`` (``models.datasets.to_loader``): Opacus replaces its sampler.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from models.dataset import Dataset


class Batches:
    """``(x, y)`` tensor batches of ``data``, shuffled each pass when ``shuffle``, the last one short; each batch a
    tensor of its own, as ``DataLoader``'s (a model that changes its input in place cannot change the data)."""

    def __init__(self, data: Dataset, *, batch_size: int, shuffle: bool, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if shuffle and len(data) == 0:  # as RandomSampler refuses it
            raise ValueError("cannot shuffle an empty dataset: it has no samples to train on")
        self.x = torch.from_numpy(data.x)
        self.y = torch.from_numpy(data.y)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(len(self.y) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # DataLoader's base seed, as iter() starts
        return self._shuffled() if self.shuffle else self._in_order()

    def _in_order(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.y), self.batch_size):
            stop = start + self.batch_size
            yield self.x[start:stop].clone(), self.y[start:stop].clone()

    def _shuffled(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n, size = len(self.y), self.batch_size
        order = torch.randperm(n, generator=self.generator)
        for start in range(0, n, size):
            chosen = order[start : start + size]
            if len(chosen) < size:  # the sampler ran out to fill this short batch: its remainder permutation
                torch.randperm(n, generator=self.generator)
            yield self.x[chosen], self.y[chosen]
        if n % size == 0:  # ... or when asked for a batch after the last full one
            torch.randperm(n, generator=self.generator)
