"""``models.sgd.MomentumSGD`` makes ``torch.optim.SGD``'s update bit for bit, and a training does not import
``torch._dynamo`` (the import it exists to avoid)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import models.training
from models.datasets import load_digits, to_loader
from models.sgd import MomentumSGD
from models.training import collect_momentum, restore_momentum, seed_training, train_sgd
from models.weights import to_arrays
from models.zoo import build_model
from protocol.messages import TrainSettings


def trained(make, momentum: float, start: dict | None = None, steps: int = 12) -> tuple[dict, dict]:
    """A digits CNN after ``steps`` mini-batches with the optimizer ``make`` builds; its weights and buffers."""
    seed_training(3)
    model = build_model("digits_cnn", num_classes=10)
    optimizer = make(model.parameters(), lr=0.05, momentum=momentum)
    restore_momentum(optimizer, model, start or {})
    loss_fn = torch.nn.CrossEntropyLoss()
    train, _ = load_digits()
    for step, (x, y) in enumerate(to_loader(train, batch_size=32, shuffle=True, seed=5)):
        if step == steps:
            break
        optimizer.zero_grad(set_to_none=step % 2 == 0)  # both ways of clearing
        loss_fn(model(x), y).backward()
        optimizer.step()
    return to_arrays(model), collect_momentum(optimizer, model)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_the_update_is_torch_optim_sgds_bit_for_bit(momentum):
    ours, our_buffers = trained(MomentumSGD, momentum)
    theirs, their_buffers = trained(torch.optim.SGD, momentum)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])
    parameters = {name for name, _ in build_model("digits_cnn", num_classes=10).named_parameters()}
    assert our_buffers.keys() == their_buffers.keys() == (parameters if momentum else set())
    for name in their_buffers:
        np.testing.assert_array_equal(our_buffers[name], their_buffers[name])


def test_restored_momentum_continues_the_same_way():
    _, buffers = trained(torch.optim.SGD, 0.9, steps=3)
    ours, _ = trained(MomentumSGD, 0.9, start=buffers)
    theirs, _ = trained(torch.optim.SGD, 0.9, start=buffers)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])


def test_a_parameter_without_gradient_is_left_alone():
    frozen, moving = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optimizer = MomentumSGD([frozen, moving], lr=0.5, momentum=0.9)
    (moving * 2).sum().backward()
    optimizer.step()
    assert torch.equal(frozen.detach(), torch.ones(3)) and frozen not in optimizer.state
    assert torch.equal(moving.detach(), torch.zeros(3))  # 1 - 0.5 * 2


def test_training_does_not_import_the_compiler():
    code = (
        "import sys; from models.datasets import load_digits; from models.training import train_sgd;"
        "from models.zoo import build_model; import torch;"
        "train_sgd(build_model('digits_cnn', num_classes=10), load_digits()[0], epochs=1, batch_size=64, lr=0.05,"
        " momentum=0.9, seed=0, device=torch.device('cpu'));"
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_train_sgd_builds_it_and_opacus_gets_torch_optims(monkeypatch):
    built: list[str] = []
    for module, name in ((models.training, "MomentumSGD"), (torch.optim, "SGD")):
        cls = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _cls=cls, **k: built.append(_cls.__name__) or _cls(*a, **k))
    train, _ = load_digits()

    def prepare(model, optimizer, loader):  # noqa: ANN001, ANN202 - as Opacus' make_private is called
        assert isinstance(optimizer, torch.optim.Optimizer)
        return model, optimizer, loader

    for hook in (None, prepare):
        outcome = train_sgd(build_model("digits_cnn", num_classes=10), train, epochs=1, batch_size=64, lr=0.05,
                            momentum=0.9, seed=0, device=torch.device("cpu"), prepare=hook)  # fmt: skip
        assert outcome.samples == len(train) and np.isfinite(outcome.loss) and outcome.momentum
    assert built == ["MomentumSGD", "SGD"]


@pytest.mark.parametrize("key, value", [("lr", -0.1), ("lr", float("nan")), ("momentum", -0.5),
                                        ("momentum", float("inf"))])
def test_a_negative_or_non_finite_lr_or_momentum_is_refused_in_the_settings(key, value):
    """torch.optim.SGD refused a negative one itself; the settings now do, for every optimizer (and NaN too)."""
    with pytest.raises(ValueError, match=f"training.{key} must be a finite number >= 0"):
        TrainSettings(**{key: value})
