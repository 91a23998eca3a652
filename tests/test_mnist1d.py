"""MNIST-1D (generated offline), its 1-D CNN, and every classify agent's local test split."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from models import partition
from models.datasets import load_npz
from models.mnist1d import load_mnist1d
from models.onnx_export import export_global
from models.training import evaluate_arrays
from models.weights import to_arrays
from models.zoo import build_model
from protocol.config import write_toml
from security.keys import Identity
from sim.classify_layout import write_classify_data
from skyfed import main

DIGITS = [str(d) for d in range(10)]


def _no_network(*_args: object, **_kwargs: object) -> None:
    raise OSError("network blocked by the test")


def test_mnist1d_is_generated_offline_the_same_every_time_and_leaves_global_random_state_alone(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", _no_network)
    np.random.seed(7)
    random.seed(7)
    load_mnist1d.cache_clear()
    train, test = load_mnist1d()
    assert np.random.random() == np.random.RandomState(7).random_sample()  # as if it had never run
    assert random.random() == random.Random(7).random()
    load_mnist1d.cache_clear()
    again_train, again_test = load_mnist1d()
    assert train.x.shape == (4000, 1, 40) and test.x.shape == (1000, 1, 40)
    assert np.array_equal(train.x, again_train.x) and np.array_equal(test.y, again_test.y)
    assert set(np.unique(train.y)) == set(range(10)) and not train.x.flags.writeable  # the cached copy is shared


def test_holdout_takes_a_stratified_fifth_exactly_and_by_seed():
    labels = np.array([0] * 7 + [1] * 3 + [2] * 10)  # quotas 1.4, 0.6, 2.0: floors 1, 0, 2 and one more for 1
    kept, held = partition.holdout(labels, 0.2, seed=(0, 1))
    assert np.bincount(labels[held]).tolist() == [1, 1, 2]
    assert sorted([*kept, *held]) == list(range(20)) and not set(kept) & set(held)
    assert np.array_equal(held, partition.holdout(labels, 0.2, seed=(0, 1))[1])
    assert any(not np.array_equal(held, partition.holdout(labels, 0.2, seed=(s, 1))[1]) for s in range(1, 5))


def _rows(path: Path) -> tuple[list[bytes], np.ndarray]:
    data = load_npz(path)
    return [row.tobytes() for row in data.x], data.y


@pytest.mark.parametrize("spec", ["iid", "shards", "shards:3", "dirichlet:0.5"])
def test_every_partition_gives_each_mnist1d_agent_data_and_a_disjoint_stratified_local_test_split(tmp_path, spec):
    names = [f"a{i}" for i in range(5)]
    train_hist, _, _ = write_classify_data(tmp_path, names, spec, seed=3, dataset="mnist1d")
    seen: list[bytes] = []
    for name, hist in zip(names, train_hist, strict=True):
        train_rows, train_y = _rows(tmp_path / name / "data.npz")
        test_rows, test_y = _rows(tmp_path / name / "test.npz")
        assert len(train_rows) == hist.sum() > 0 and len(test_rows) == round(0.2 * (len(train_rows) + len(test_rows)))
        share = np.bincount(np.concatenate([train_y, test_y]), minlength=10)
        assert np.all(np.abs(np.bincount(test_y, minlength=10) - 0.2 * share) < 1)  # stratified by label
        if spec.startswith("shards"):  # K label-sorted shards of 4000 / (5 K) signals: at most 2 labels each
            assert np.count_nonzero(share) <= 2 * int(spec.partition(":")[2] or 2)
        seen += train_rows + test_rows
    assert len(seen) == len(set(seen)) == 4000  # every pool signal with exactly one agent, trained or held out
    server_rows, _ = _rows(tmp_path / "server" / "test.npz")
    assert len(server_rows) == 1000 and not set(server_rows) & set(seen)  # MNIST-1D's own test split


def test_signals_round_trip_through_the_agent_data_format(tmp_path):
    train, _ = load_mnist1d()
    write_classify_data(tmp_path, ["a1"], "iid", seed=0, dataset="mnist1d")
    with np.load(tmp_path / "a1" / "data.npz") as raw:
        assert raw["x"].shape == (3200, 40)  # (N, L): single-channel signals
    assert load_npz(tmp_path / "a1" / "data.npz").x.shape == (3200, 1, 40)


def test_mnist1d_cnn_is_the_paper_size_and_exports_to_onnx(tmp_path):
    model = build_model("mnist1d_cnn")
    assert sum(p.numel() for p in model.parameters()) == 5_210
    report = export_global("mnist1d_cnn", to_arrays(model), tmp_path / "m.onnx", names=DIGITS, image_size=0)
    assert report.ok and report.max_abs_diff <= 1e-4, report.reason


def test_evaluate_arrays_scores_a_local_test_split_as_the_server_evaluator_does(tmp_path):
    from broker_server.rounds.evaluation import ClassifierEvaluator

    write_classify_data(tmp_path, ["a1", "a2"], "shards", seed=0, dataset="mnist1d")
    arrays = to_arrays(build_model("mnist1d_cnn"))
    split = tmp_path / "a2" / "test.npz"
    mine = evaluate_arrays("mnist1d_cnn", arrays, load_npz(split), torch.device("cpu"))
    assert set(mine) == {"accuracy", "loss"} and 0 <= mine["accuracy"] <= 1
    server = ClassifierEvaluator("mnist1d_cnn", 10, split)(arrays)
    assert mine == pytest.approx(server, abs=1e-5)


def _agent_toml(root: Path, name: str, **agent: str) -> Path:
    server = Identity.generate("server")
    Identity.generate(name).save(root / name)
    server.public.save(root / name / "server.pub")
    path = root / name / "agent.toml"
    write_toml(path, {"agent": {"id": name, "federation": "fleet", "state_dir": "state", "data": "data.npz", **agent},
                      "broker": {"host": "127.0.0.1", "port": 1883},
                      "keys": {"identity": f"{name}.key", "server": "server.pub"}})  # fmt: skip
    return path


def test_skyfed_data_mnist1d_writes_what_agent_check_accepts_and_a_bad_test_split_is_one_line(tmp_path, capsys):
    assert main(["data", "mnist1d", "a1", "a2", "--out", str(tmp_path), "--partition", "shards:2"]) == 0
    out = capsys.readouterr().out
    assert "a1/data.npz and test.npz" in out and "held out to test" in out
    config = _agent_toml(tmp_path, "a1", test_data="test.npz")
    assert main(["agent", "check", "--config", str(config)]) == 0
    assert f"test_data={tmp_path / 'a1' / 'test.npz'}" in capsys.readouterr().out
    (tmp_path / "a1" / "test.npz").write_bytes(b"not an npz")
    assert main(["agent", "check", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "agent.test_data = 'test.npz'" in err and "cannot be read as .npz" in err
    missing = _agent_toml(tmp_path, "a2", test_data="nowhere.npz")
    assert main(["agent", "check", "--config", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "agent.test_data = 'nowhere.npz': local test split not found" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dataset", "mnist2d"], "--dataset must be one of digits, mnist1d, got 'mnist2d'"),
        (["--dataset", "mnist1d", "--model", "digits_cnn"], "use --model mnist1d_cnn"),
        (["--task", "detect", "--dataset", "mnist1d"], "--dataset mnist1d is for --task classify"),
    ],
)
def test_a_bad_dataset_is_one_line(tmp_path, capsys, flags, message):
    assert main(["sim", "--in-process", "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_a_short_mnist1d_sim_learns_and_gives_each_agent_a_local_test_split(tmp_path):
    """Measured: 0.356 after 3 rounds (seed 0, the default dirichlet:0.5 and aggregation); chance is 0.1."""
    out = tmp_path / "run"
    assert main(["sim", "--in-process", "--dataset", "mnist1d", "--agents", "4", "--rounds", "3",
                 "--out", str(out)]) == 0  # fmt: skip
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 3 and rounds[-1]["eval"]["accuracy"] > 0.25
    agent = out / "federation" / "agent-01"
    assert 'test_data = "test.npz"' in (agent / "agent.toml").read_text() and (agent / "test.npz").is_file()
