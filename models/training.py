"""Local training and evaluation loops for classifiers (shared by the agent's trainer and the server).

Plain PyTorch: SGD with momentum (``models.sgd``: ``torch.optim.SGD``'s update without its compiler import; or
AdamW, ``optimizer = "adamw"``: seed 002 compares the two) over mini-batches, cross-entropy loss, plus FedProx's
proximal term (μ/2)·‖w − w_start‖² over the trainable parameters when ``prox_mu`` > 0 (Li et al. 2020, "Federated
Optimization in Heterogeneous Networks", https://arxiv.org/abs/1812.06127). Runs on CUDA when present
and on the CPU otherwise. The YOLO trainer (Ultralytics) will be a separate plug-in with its own loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader

from models.batches import Batches
from models.datasets import Dataset, to_loader
from models.sgd import MomentumSGD
from models.weights import NamedArrays, load_arrays
from models.zoo import build_model

# wraps the model, optimizer and loader before the first step (DP-SGD: participant.local_dp.dp_sgd)
Prepare = Callable[[nn.Module, torch.optim.Optimizer, DataLoader], tuple[nn.Module, torch.optim.Optimizer, DataLoader]]
Stepper = torch.optim.Optimizer | MomentumSGD  # what holds the momentum buffers (``state[param]``)


@dataclass(frozen=True)
class TrainOutcome:
    samples: int
    loss: float
    momentum: NamedArrays = field(default_factory=dict)  # parameter name -> SGD momentum buffer at the end


def seed_training(seed: int) -> None:
    """Seed PyTorch's CPU generator, and CUDA's where present, before a training. ``torch.manual_seed`` also
    queues a lazy seed with a formatted Python stack for each accelerator backend not yet initialised: in a
    host of 100 agents (py-spy) that was about a third of a small training's CPU time."""
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)``, skipped when its first parameter is there already: ``to`` walks every module and
    tensor in Python, a tenth of a small model's training and two evaluations on an agent (py-spy)."""
    first = next(model.parameters(), None)
    return model if first is not None and first.device == device else model.to(device)


def train_sgd(
    model: nn.Module,
    data: Dataset,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    seed: int,
    device: torch.device,
    prox_mu: float = 0.0,
    work: float = 1.0,
    prepare: Prepare | None = None,
    momentum_start: NamedArrays | None = None,
    optimizer: str = "sgd",
    anchor: NamedArrays | None = None,
) -> TrainOutcome:
    """Train ``model`` in place; return the sample count and the mean loss (without the proximal term)
    of the last epoch. ``work`` < 1 stops after that share of the epochs' mini-batches (at least one):
    FedProx's partial work, so a slow device still reports in time. ``prepare`` wraps the training
    objects first (the loop is the same for DP-SGD: Opacus' optimizer clips and adds noise in ``step``).
    ``momentum_start`` (parameter name -> buffer) continues an earlier run's SGD momentum instead of zero.
    ``optimizer`` is ``sgd`` (with ``momentum``) or ``adamw`` (``torch.optim.AdamW`` at ``lr``, its default betas
    and weight decay 0.01; ``momentum`` and ``momentum_start`` do not apply to it). ``anchor`` (named arrays) is what
    the proximal term pulls toward instead of the model's own start (Ditto's personal model toward the global one)."""
    on_device(model, device).train()
    start = proximal_anchor(model, anchor, device) if prox_mu > 0 else []
    unwrapped = model  # ``prepare`` may wrap the model and optimizer; parameters and momentum state stay these
    chosen: Stepper
    if optimizer == "adamw":
        chosen = torch.optim.AdamW(model.parameters(), lr=lr)
    elif optimizer == "sgd":  # Opacus (``prepare``) wraps a torch.optim.Optimizer; else the same update, lighter
        chosen = (torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum) if prepare is not None
                  else MomentumSGD(model.parameters(), lr=lr, momentum=momentum))  # fmt: skip
        restore_momentum(chosen, unwrapped, momentum_start or {})
    else:  # protocol.messages.TrainSettings refuses other names first
        raise ValueError(f"optimizer must be sgd or adamw, got {optimizer!r}")
    stepper = chosen
    loss_fn = nn.CrossEntropyLoss()
    loader: DataLoader | Batches
    if prepare is not None:  # Opacus replaces a DataLoader's sampler with its Poisson sampling
        loader = to_loader(data, batch_size=batch_size, shuffle=True, seed=seed)
        model, stepper, loader = prepare(model, stepper, loader)
    else:
        loader = Batches(data, batch_size=batch_size, shuffle=True, seed=seed)
    last_loss = float("nan")
    steps_left = max(1, math.ceil(work * epochs * len(loader)))
    for _ in range(epochs):
        if steps_left == 0:
            break
        total, seen = 0.0, 0
        for x, y in loader:
            if steps_left == 0:
                break
            steps_left -= 1
            x, y = x.to(device), y.to(device)
            stepper.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            objective = loss + prox_mu / 2 * proximal(model, start) if start else loss
            objective.backward()
            stepper.step()
            if len(y):  # a Poisson-sampled batch may be empty
                total += loss.item() * len(y)
                seen += len(y)
        last_loss = total / max(seen, 1)  # no batch at all: an empty dataset
    return TrainOutcome(samples=len(data), loss=last_loss, momentum=collect_momentum(chosen, unwrapped))


def restore_momentum(optimizer: Stepper, model: nn.Module, buffers: NamedArrays) -> int:
    """Put ``buffers`` (parameter name -> SGD momentum buffer) into ``optimizer``'s state for ``model``'s
    parameters of the same name and shape; how many were put (the others start from zero)."""
    restored = 0
    for name, param in model.named_parameters():
        buffer = buffers.get(name)
        if buffer is not None and tuple(buffer.shape) == tuple(param.shape):
            optimizer.state[param]["momentum_buffer"] = torch.tensor(buffer, dtype=param.dtype, device=param.device)
            restored += 1
    return restored


def collect_momentum(optimizer: Stepper, model: nn.Module) -> NamedArrays:
    """``model``'s parameters' momentum buffers in ``optimizer`` (a parameter it never stepped has none)."""
    buffers = {}
    for name, param in model.named_parameters():
        buffer = optimizer.state.get(param, {}).get("momentum_buffer")
        if buffer is not None:
            buffers[name] = buffer.detach().float().cpu().numpy()
    return buffers


def proximal_anchor(model: nn.Module, anchor: NamedArrays | None, device: torch.device) -> list[torch.Tensor]:
    """The proximal term's target, one tensor per parameter: ``anchor``'s (by name), or the model's own start."""
    if anchor is None:
        return [p.detach().clone() for p in model.parameters()]
    return [torch.as_tensor(anchor[name], device=device) for name, _ in model.named_parameters()]


def proximal(model: nn.Module, start: list[torch.Tensor]) -> torch.Tensor:
    """‖w − w_start‖² over the trainable parameters (FedProx's term without μ/2)."""
    return sum(((p - s) ** 2).sum() for p, s in zip(model.parameters(), start, strict=True))  # type: ignore[return-value]


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, device: torch.device, batch_size: int = 1024) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` on ``data``."""
    on_device(model, device).eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    correct, total_loss = 0, 0.0
    for x, y in Batches(data, batch_size=batch_size, shuffle=False, seed=0):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        total_loss += float(loss_fn(logits, y))
        correct += int((logits.argmax(dim=1) == y).sum())
    n = max(len(data), 1)
    return {"accuracy": correct / n, "loss": total_loss / n}


def evaluate_arrays(
    model_name: str, arrays: NamedArrays, data: Dataset, device: torch.device, num_classes: int = 10
) -> dict[str, float]:
    """Accuracy and mean cross-entropy of zoo model ``model_name`` holding ``arrays`` on ``data``: e.g. the
    model an agent starts a round from, on its local test split (``agent.test_data``)."""
    model = build_model(model_name, num_classes=num_classes)
    load_arrays(model, arrays)
    return evaluate(model, data, device)
