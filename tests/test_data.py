"""Datasets in the agent format and the partitioners."""

import numpy as np
import pytest

from models import partition
from models.datasets import Dataset, load_dataset, load_digits, load_npz, save_npz


@pytest.fixture(scope="module")
def labels():
    return load_digits(seed=0)[0].y


@pytest.mark.parametrize("spec", ["iid", "shards", "shards:3", "dirichlet:0.5"])
def test_partitions_are_deterministic_disjoint_and_complete(labels, spec):
    parts = partition.parse(spec)(labels, 5, 42)
    again = partition.parse(spec)(labels, 5, 42)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    joined = np.concatenate(parts)
    assert len(joined) == len(labels) and len(np.unique(joined)) == len(labels)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, partition.parse(spec)(labels, 5, 43), strict=True))


def test_shards_give_each_client_few_labels(labels):
    parts = partition.shards(labels, 10, seed=0, shards_per_client=2)
    labels_per_client = (partition.label_histogram(labels, parts, 10) > 0).sum(axis=1)
    assert labels_per_client.max() <= 4 and labels_per_client.mean() < 4


def test_smaller_dirichlet_alpha_means_more_skew(labels):
    def mean_entropy(alpha):
        hist = partition.label_histogram(labels, partition.dirichlet(labels, 5, 0, alpha=alpha), 10)
        p = hist / hist.sum(axis=1, keepdims=True)
        return float(np.mean(-np.sum(p * np.log(np.where(p > 0, p, 1.0)), axis=1)))

    assert mean_entropy(0.1) < mean_entropy(100.0) - 0.5


@pytest.mark.parametrize("spec", ["", "dirichlet", "dirichlet:x", "shards:two", "random"])
def test_bad_partition_specs_list_the_accepted_forms(spec):
    with pytest.raises(ValueError, match="dirichlet:ALPHA"):
        partition.parse(spec)


def test_npz_round_trip_and_uint8_hw_images(tmp_path):
    train, _ = load_digits(seed=0)
    save_npz(tmp_path / "data.npz", train)
    assert np.array_equal(load_dataset(tmp_path).y, train.y)
    np.savez(tmp_path / "raw.npz", x=np.full((4, 8, 8), 255, np.uint8), y=np.arange(4))
    ds = load_npz(tmp_path / "raw.npz")
    assert ds.x.shape == (4, 1, 8, 8) and ds.x.max() == 1.0 and ds.y.dtype == np.int64


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((2, 8, 8))}, "no array 'y'"),
        ({"x": np.zeros((2, 8, 8)), "y": np.zeros(3, np.int64)}, "x has 2 samples"),
        ({"x": np.zeros((2, 8, 8)), "y": np.zeros(2)}, "integer labels"),
        ({"x": np.full((2, 8, 8), np.nan), "y": np.zeros(2, np.int64)}, "NaN"),
    ],
)
def test_bad_agent_data_names_the_file_and_problem(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=message) as err:
        load_npz(path)
    assert str(path) in str(err.value)


def test_pickled_object_arrays_are_never_loaded(tmp_path):
    path = tmp_path / "evil.npz"
    np.savez(path, x=np.array([object()], dtype=object), y=np.zeros(1, np.int64))
    with pytest.raises(ValueError, match=str(path)):
        load_npz(path)


def test_dataset_requires_matching_lengths_and_dtypes():
    with pytest.raises(ValueError):
        Dataset(np.zeros((2, 1), np.float64), np.zeros(2, np.int64))
