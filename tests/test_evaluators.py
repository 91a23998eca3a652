"""The server's classifier evaluator (``models.evaluators``) scores named arrays as ``evaluate`` scores a
plain model, though its own copy of a zoo model runs its convolutions channels-last (the loss to float32 rounding:
sums taken in another order). An operator's own model keeps its layout: its code may ``view`` its activations."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from models.datasets import load_digits, save_npz
from models.evaluators import ClassifierEvaluator
from models.training import evaluate_arrays
from models.weights import to_arrays
from models.zoo import build_model


@pytest.mark.parametrize("model_name", ["digits_cnn", "mlp_digits"])
def test_the_evaluator_scores_as_a_plain_model_does(tmp_path, model_name):
    _, test = load_digits()
    save_npz(tmp_path / "eval.npz", test)
    evaluator = ClassifierEvaluator(model_name, 10, tmp_path / "eval.npz")
    for seed in range(3):
        torch.manual_seed(seed)
        model = build_model(model_name, num_classes=10)
        with torch.no_grad():  # away from the initialisation, running statistics included
            for name, tensor in model.state_dict().items():
                if name.endswith("running_var"):
                    tensor.uniform_(0.5, 2.0)
                elif tensor.is_floating_point():
                    tensor.add_(torch.randn_like(tensor) * 0.1)
        arrays = to_arrays(model)
        plain = evaluate_arrays(model_name, arrays, test, torch.device("cpu"))
        scores = evaluator(arrays)
        assert scores["accuracy"] == round(plain["accuracy"], 6)  # the same predictions, sample for sample
        assert scores["loss"] == pytest.approx(plain["loss"], rel=1e-6)  # float32 sums in another order
    convs = [p for p in evaluator.model.parameters() if p.dim() == 4]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in convs), "loading keeps the layout"
    assert bool(convs) == (model_name == "digits_cnn")


OWN_CNN = """
from torch import nn

INPUT_SHAPE = (1, 8, 8)


class Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, num_classes)

    def forward(self, x):
        x = self.conv(x)
        return self.fc(x.view(x.size(0), -1))  # needs the default layout


def build(num_classes):
    return Net(num_classes)
"""


def test_an_operators_own_model_is_evaluated_in_its_own_layout(tmp_path, monkeypatch):
    (tmp_path / "evalown_model.py").write_text(textwrap.dedent(OWN_CNN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evalown_model", raising=False)
    _, test = load_digits()
    save_npz(tmp_path / "eval.npz", test)
    evaluator = ClassifierEvaluator("evalown_model:build", 10, tmp_path / "eval.npz")
    arrays = to_arrays(build_model("evalown_model:build", num_classes=10))
    scores = evaluator(arrays)
    assert set(scores) == {"accuracy", "loss"} and 0 <= scores["accuracy"] <= 1
    assert not any(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                   for p in evaluator.model.parameters())  # fmt: skip
