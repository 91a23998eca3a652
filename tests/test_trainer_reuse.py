"""``ClassifierTrainer`` loads each round's start into the module it trained last round: the same result as a
module built afresh, bit for bit, and never a module DP-SGD (Opacus) hooked."""

from __future__ import annotations

import numpy as np
import torch

from models.datasets import load_digits
from models.weights import to_arrays
from models.zoo import build_model
from participant.classifier import ClassifierTrainer
from participant.local_dp import LocalPrivacySection, PrivacyBudget
from protocol.messages import TrainSettings
from tests.fedharness import round_task

SETTINGS = TrainSettings(epochs=2, batch_size=16, lr=0.05, momentum=0.9)


def trainer(tmp_path, name: str, budget: PrivacyBudget | None = None) -> ClassifierTrainer:
    train, test = load_digits()
    return ClassifierTrainer(train.subset(np.arange(60)), device=torch.device("cpu"), agent_id="agent-01",
                             work_dir=tmp_path / name, test_data=test.subset(np.arange(30)), budget=budget)  # fmt: skip


def starts() -> list[dict[str, np.ndarray]]:
    out = []
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        out.append(to_arrays(build_model("digits_cnn", num_classes=10)))
    return out


def test_a_kept_module_trains_as_a_new_one(tmp_path):
    kept = trainer(tmp_path, "kept")
    for number, start in enumerate(starts(), 1):
        task = round_task(round=number, train=SETTINGS)
        ours = kept.train(start, task)
        theirs = trainer(tmp_path, f"fresh-{number}").train(start, task)  # builds its module afresh
        assert ours.loss == theirs.loss and ours.trained_eval == theirs.trained_eval
        assert ours.start_eval == theirs.start_eval
        for name, array in theirs.arrays.items():
            np.testing.assert_array_equal(ours.arrays[name], array)
        assert len(kept._spare) == 1  # the module it trained, waiting for the next round


def test_results_do_not_share_memory_with_the_kept_module(tmp_path):
    kept = trainer(tmp_path, "kept")
    first, second = starts()[:2]
    result = kept.train(first, round_task(round=1, train=SETTINGS))
    before = {name: array.copy() for name, array in result.arrays.items()}
    kept.train(second, round_task(round=2, train=SETTINGS))
    for name, array in before.items():
        np.testing.assert_array_equal(result.arrays[name], array)


def test_dp_sgd_keeps_no_module(tmp_path):
    policy = LocalPrivacySection(noise_multiplier=1.0, max_grad_norm=1.0)
    private = trainer(tmp_path, "dp", PrivacyBudget(policy, tmp_path / "p.json", 60))
    private.train(to_arrays(build_model("mlp_digits")), round_task(model="mlp_digits", round=1, train=SETTINGS))
    assert private._spare == {}
    plain = trainer(tmp_path, "plain")
    plain.train(to_arrays(build_model("mlp_digits")), round_task(model="mlp_digits", round=1, train=SETTINGS))
    assert list(plain._spare) == [("mlp_digits", 10)]
