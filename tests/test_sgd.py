"""``models.sgd.MomentumSGD`` makes ``torch.optim.SGD``'s update bit for bit, and a training does not import
``torch._dynamo`` (the import it exists to avoid)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from models.datasets import load_digits, to_loader
from models.sgd import MomentumSGD
from models.training import collect_momentum, restore_momentum, seed_training, train_sgd
from models.weights import to_arrays
from models.zoo import build_model


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


def test_train_sgd_uses_it_unless_opacus_wraps_the_optimizer():
    train, _ = load_digits()
    seed_training(0)
    outcome = train_sgd(build_model("digits_cnn", num_classes=10), train, epochs=1, batch_size=64, lr=0.05,
                        momentum=0.9, seed=0, device=torch.device("cpu"))  # fmt: skip
    assert outcome.samples == len(train) and np.isfinite(outcome.loss) and outcome.momentum
