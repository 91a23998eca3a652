"""``[training] keep_momentum``: an agent's SGD momentum continues from its last round (participant.momentum) in
the classifier and the YOLO trainer, only within one run and model, and nothing changes when it is off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import participant.detector
from models.datasets import load_digits
from models.serialization import load_file
from models.training import collect_momentum, restore_momentum
from models.weights import to_arrays
from models.zoo import build_model
from participant.classifier import ClassifierTrainer
from participant.local_dp import LocalPrivacySection, PrivacyBudget
from participant.momentum import MOMENTUM_FILE, MomentumStore
from protocol.messages import TrainSettings
from tests.fedharness import round_task
from tests.fixtures import detect_task, start_arrays, trainer_for

KEEP = TrainSettings(epochs=1, batch_size=32, lr=0.05, keep_momentum=True)


def test_a_restored_buffer_drives_the_next_sgd_step():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = {"weight": np.full((2, 3), 2.0, np.float32), "bias": np.ones(5, np.float32)}  # bias: wrong shape
    assert restore_momentum(optimizer, model, kept) == 1
    before = model.weight.detach().clone()
    model.weight.grad = torch.zeros_like(model.weight)  # no gradient: the step is lr * momentum * buffer
    optimizer.step()
    assert torch.allclose(before - model.weight.detach(), torch.full((2, 3), 0.1 * 0.9 * 2.0))
    assert set(collect_momentum(optimizer, model)) == {"weight"}  # the bias was never stepped


def test_the_store_keeps_buffers_for_the_same_run_and_model_only(tmp_path, caplog):
    store = MomentumStore(tmp_path)
    task = round_task(run_id="run-a", train=KEEP)
    buffers = {"w": np.arange(4, dtype=np.float32)}
    store.keep(task, KEEP, buffers)
    np.testing.assert_array_equal(store.start(task, KEEP)["w"], buffers["w"])
    assert store.start(round_task(run_id="run-b"), KEEP) == {}  # a new run starts from zero
    assert store.start(round_task(run_id="run-a", model="mlp_digits"), KEEP) == {}
    assert store.start(task, TrainSettings()) == {}  # off: not used even when present
    (tmp_path / MOMENTUM_FILE).write_bytes(b"\x00garbage")
    assert store.start(task, KEEP) == {} and "unreadable" in caplog.text
    other = MomentumStore(tmp_path / "off")
    other.keep(task, TrainSettings(), buffers)
    assert not (tmp_path / "off" / MOMENTUM_FILE).exists()


def test_a_diverged_round_leaves_no_momentum_behind(tmp_path, caplog):
    store, task = MomentumStore(tmp_path), round_task(run_id="run-a", train=KEEP)
    store.keep(task, KEEP, {"w": np.ones(3, np.float32)})
    store.keep(task, KEEP, {"w": np.array([1.0, np.nan, 2.0], np.float32)})
    assert store.start(task, KEEP) == {} and "non-finite" in caplog.text


def test_dp_sgd_keeps_the_momentum_of_its_noisy_steps(tmp_path):
    train, _ = load_digits(test_fraction=0.9, seed=0)
    policy = LocalPrivacySection(noise_multiplier=1.0, max_grad_norm=1.0)
    budget = PrivacyBudget(policy, tmp_path / "p.json", len(train))
    trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path, budget=budget)
    trainer.train(to_arrays(build_model("mlp_digits")), round_task(model="mlp_digits", run_id="r", train=KEEP))
    kept, _ = load_file(tmp_path / MOMENTUM_FILE)  # Opacus steps the same optimizer state (post-processing)
    assert set(kept) == {n for n, _ in build_model("mlp_digits").named_parameters()}
    assert all(np.isfinite(b).all() and np.abs(b).max() > 0 for b in kept.values())


def classifier_round2(tmp_path, keep: bool, warm: bool) -> dict[str, np.ndarray]:
    """Round 2's weights of a classifier agent; ``warm``: the same agent trained round 1 before."""
    train, _ = load_digits(test_fraction=0.8, seed=0)
    settings = TrainSettings(epochs=1, batch_size=32, lr=0.05, keep_momentum=keep)
    trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path)
    start = to_arrays(build_model("mlp_digits"))
    if warm:
        trainer.train(start, round_task(model="mlp_digits", run_id="r", round=1, train=settings))
    return trainer.train(start, round_task(model="mlp_digits", run_id="r", round=2, train=settings)).arrays


def test_the_classifier_continues_its_momentum_only_when_asked(tmp_path):
    kept = classifier_round2(tmp_path / "kept", keep=True, warm=True)
    fresh = classifier_round2(tmp_path / "fresh", keep=True, warm=False)
    assert (tmp_path / "kept" / MOMENTUM_FILE).exists()
    assert max(float(np.abs(kept[n] - fresh[n]).max()) for n in kept) > 1e-4  # round 1's momentum moved round 2
    off_warm = classifier_round2(tmp_path / "off-warm", keep=False, warm=True)
    off_fresh = classifier_round2(tmp_path / "off-fresh", keep=False, warm=False)
    assert all(np.array_equal(off_warm[n], off_fresh[n]) for n in off_warm)  # off: every round starts at zero
    assert not (tmp_path / "off-warm" / MOMENTUM_FILE).exists()


def test_the_yolo_trainer_restores_its_momentum_into_ultralytics_optimizer(dataset, tmp_path, monkeypatch):  # noqa: F811
    restored: list[int] = []

    def spy(optimizer: torch.optim.Optimizer, model: nn.Module, buffers: dict) -> int:
        restored.append(restore_momentum(optimizer, model, buffers))
        return restored[-1]

    monkeypatch.setattr(participant.detector, "restore_momentum", spy)
    trainer = trainer_for(dataset, tmp_path)
    keep = TrainSettings(epochs=1, batch_size=4, lr=0.01, image_size=64, keep_momentum=True)
    first = trainer.train(start_arrays(1), detect_task(run_id="r", train=keep))
    kept, _ = load_file(tmp_path / "work" / MOMENTUM_FILE)
    trainable = [n for n, p in build_model("yolo11n", 4).named_parameters() if ".dfl." not in n]
    assert set(kept) == set(trainable) and any(np.abs(b).max() > 0 for b in kept.values())
    trainer.train(first.arrays, detect_task(run_id="r", round=2, train=keep))
    assert restored == [0, len(trainable)]  # round 1 from zero, round 2 from every kept buffer


@pytest.mark.parametrize("value", [True, False])
def test_the_setting_travels_in_the_signed_task(value):
    task = round_task(train=TrainSettings(keep_momentum=value))
    assert type(task).from_json(task.to_json()).train.keep_momentum is value
