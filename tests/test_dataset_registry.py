"""Classify datasets as plug-ins (``models.classify_data``): what each declares holds for its model and its
data, and one registered by a test becomes a ``skyfed data`` subcommand and a ``--dataset`` choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.classify_data import DATASETS, ClassifyData, classify_data
from models.datasets import Dataset, load_npz
from models.tasks import task_of
from models.zoo import build_model, input_shape
from skyfed import main


@pytest.mark.parametrize("name", DATASETS.names())
def test_each_dataset_declares_what_its_model_takes_and_gives(name, monkeypatch):
    """mnist1d-large is generated smaller here (the same generator; 105,000 signals take over a minute on CI):
    what is checked is what its model takes and gives, not its size."""
    monkeypatch.setattr("models.mnist1d.LARGE_TRAIN", 2_000)
    monkeypatch.setattr("models.mnist1d.LARGE_TEST", 500)
    data = DATASETS.get(name)
    assert task_of(data.model) == data.task == "classify" and input_shape(data.model) == data.sample_shape
    assert build_model(data.model, num_classes=data.num_classes)(torch.zeros(2, *data.sample_shape)).shape == (
        2, data.num_classes)  # fmt: skip
    for part in data.load(0):
        assert part.x.shape[1:] == data.sample_shape and set(np.unique(part.y)) == set(range(data.num_classes))


def _random_images(seed: int) -> tuple[Dataset, Dataset]:
    rng = np.random.default_rng(seed)
    x, y = rng.random((200, 1, 8, 8), dtype=np.float32), np.arange(200, dtype=np.int64) % 10
    return Dataset(x[:150], y[:150]), Dataset(x[150:], y[150:])


@pytest.fixture
def noise():
    data = ClassifyData("noise", "digits_cnn", (1, 8, 8), _random_images, "200 random 8x8 images, 10 labels")
    DATASETS.add("noise", data)
    yield data
    DATASETS.remove("noise")


def test_a_registered_dataset_is_a_data_subcommand_and_a_sim_choice(tmp_path, capsys, noise):
    assert main(["data", "noise", "a1", "a2", "--out", str(tmp_path)]) == 0
    assert len(load_npz(tmp_path / "server" / "test.npz")) == 50 and (tmp_path / "a2" / "data.npz").is_file()
    assert classify_data("noise") is noise
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    assert "digits|mnist1d|mnist1d-large|noise" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--dataset must be one of digits, mnist1d, mnist1d-large, noise, got 'nois'"):
        classify_data("nois")
