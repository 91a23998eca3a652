"""``models.batches.Batches`` yields ``DataLoader``'s batches, tensor for tensor, pass after pass."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from models.batches import Batches
from models.dataset import Dataset
from models.datasets import to_loader


def dataset(n: int) -> Dataset:
    rng = np.random.default_rng(n)
    return Dataset(rng.random((n, 1, 4, 4), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64))


def passes(loader, taken: list[int | None]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of successive passes over ``loader``, each cut after ``taken[i]`` batches (None: all)."""
    return [batch for count in taken for batch in itertools.islice(iter(loader), count)]


@pytest.mark.parametrize("n, batch_size", [(11, 32), (64, 32), (70, 32), (1, 1), (45, 7)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("taken", [[None, None, None], [1, None, None], [2, 1, None], [0, None, 0, None]])
def test_the_batches_are_dataloaders(n, batch_size, shuffle, taken):
    data = dataset(n)
    batches = Batches(data, batch_size=batch_size, shuffle=shuffle, seed=7)
    loader = to_loader(data, batch_size=batch_size, shuffle=shuffle, seed=7)
    assert len(batches) == len(loader)
    ours, theirs = passes(batches, taken), passes(loader, taken)
    assert len(ours) == len(theirs)
    for (x, y), (tx, ty) in zip(ours, theirs, strict=True):
        assert x.dtype == tx.dtype and y.dtype == ty.dtype
        assert torch.equal(x, tx) and torch.equal(y, ty)


def test_a_pass_cut_after_the_short_batch_leaves_the_next_pass_as_dataloaders():
    data = dataset(45)  # 7 batches of 7, the last one of 3: the sampler's remainder is drawn before it
    ours = Batches(data, batch_size=7, shuffle=True, seed=1)
    theirs = to_loader(data, batch_size=7, shuffle=True, seed=1)
    for loader in (ours, theirs):
        list(itertools.islice(iter(loader), 7))  # all seven, never asking for an eighth
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ours, theirs, strict=True))


def test_two_passes_at_once_are_dataloaders():
    data = dataset(20)
    ours = Batches(data, batch_size=8, shuffle=True, seed=3)
    theirs = to_loader(data, batch_size=8, shuffle=True, seed=3)
    first, second = [iter(ours), iter(ours)], [iter(theirs), iter(theirs)]  # both begun before either is read
    for a, b in ((first[1], second[1]), (first[0], second[0])):
        assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))


def test_a_batch_is_no_view_of_the_data():
    data = dataset(5)
    before = data.x.copy()
    for shuffle in (False, True):
        for x, _ in Batches(data, batch_size=2, shuffle=shuffle, seed=0):
            x.add_(100.0)  # a model changing its input in place
    np.testing.assert_array_equal(data.x, before)


def test_length_and_an_empty_dataset():
    assert len(Batches(dataset(70), batch_size=32, shuffle=True, seed=0)) == 3
    assert list(Batches(dataset(0), batch_size=32, shuffle=False, seed=0)) == []
    with pytest.raises(ValueError, match="empty"):
        Batches(dataset(0), batch_size=32, shuffle=True, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        Batches(dataset(3), batch_size=0, shuffle=False, seed=0)
