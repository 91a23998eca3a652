"""Local trainers: the plug-in point between a round task and a model update.

A trainer owns its data, gets the global weights (named arrays) and the round's settings, and returns
new weights plus what the server weighs them by. ``training.trainer`` in ``agent.toml`` picks one:
``classifier`` (``ClassifierTrainer``: the PyTorch CNNs and MLPs on an ``.npz``) or ``detector``
(``agent.detector.DetectorTrainer``: Ultralytics YOLO on a YOLO ``data.yaml``).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from agent.local_dp import PrivacyBudget, budget_for, dp_sgd
from models.datasets import Dataset, load_dataset
from models.serialization import dumps
from models.training import train_sgd
from models.weights import NamedArrays, load_arrays, to_arrays
from models.zoo import build_model, task_of
from protocol.messages import RoundTask
from protocol.update import UpdateMeta

if TYPE_CHECKING:
    from agent.config import AgentConfig


@dataclass(frozen=True)
class TrainResult:
    arrays: NamedArrays
    samples: int
    loss: float
    epsilon: float | None = None  # this agent's own DP-SGD epsilon after the round (local DP only)
    weight: int = 0  # what the server weighs the update by (0: ``samples``); detectors: annotated objects
    local_eval: dict[str, float] = field(default_factory=dict)  # the trainer's own validation, e.g. map50


class Trainer(Protocol):
    samples: int  # training examples this agent holds (images for detectors)
    budget: PrivacyBudget | None

    def refusal(self, task: RoundTask) -> str: ...

    def train(self, global_arrays: NamedArrays, task: RoundTask) -> TrainResult: ...


class TrainerWrapper:
    """Base of trainers that change what another one does (sim attacks and slowness, tests): everything but
    what a subclass overrides is the inner trainer's."""

    def __init__(self, inner: Trainer) -> None:
        self.inner = inner

    @property
    def samples(self) -> int:
        return self.inner.samples

    @property
    def budget(self) -> PrivacyBudget | None:
        return self.inner.budget

    def refusal(self, task: RoundTask) -> str:
        return self.inner.refusal(task)

    def train(self, global_arrays: NamedArrays, task: RoundTask) -> TrainResult:
        return self.inner.train(global_arrays, task)


def build_trainer(config: AgentConfig, device: torch.device) -> Trainer:
    """The trainer ``training.trainer`` names, with its data loaded (a bad file fails here, at start)."""
    if config.training.trainer == "detector":
        from agent.detector import DetectorTrainer

        return DetectorTrainer(config.data_path, device=device, agent_id=config.agent.id,
                               work_dir=config.state_dir / "detector", seed=config.agent.seed)  # fmt: skip
    data = load_dataset(config.data_path)
    budget = budget_for(config.privacy, config.state_dir, len(data))
    return ClassifierTrainer(data, device=device, agent_id=config.agent.id, seed=config.agent.seed, budget=budget)


class ClassifierTrainer:
    """SGD with momentum on this agent's dataset, with the round's epochs, batch size and learning rate."""

    kind = "classify"

    def __init__(
        self, data: Dataset, *, device: torch.device, agent_id: str, seed: int = 0, budget: PrivacyBudget | None = None
    ) -> None:
        self.data = data
        self.device = device
        self.agent_id = agent_id
        self.seed_base = seed * 1_000_003 + zlib.crc32(agent_id.encode())
        self.budget = budget  # DP-SGD (agent.local_dp) when given

    @property
    def samples(self) -> int:
        return len(self.data)

    def refusal(self, task: RoundTask) -> str:
        if task_of(task.model) != self.kind:
            return f"wrong-task: {task.model} is not a classifier; set training.trainer to match the federation"
        return ""

    def train(self, global_arrays: NamedArrays, task: RoundTask) -> TrainResult:
        model = build_model(task.model, num_classes=task.num_classes)
        load_arrays(model, global_arrays)
        torch.manual_seed(self.seed_base + task.round)
        settings = task.train_of(self.agent_id)
        prepare, spent = dp_sgd(self.budget.policy) if self.budget is not None else (None, None)
        outcome = train_sgd(
            model,
            self.data,
            epochs=settings.epochs,
            batch_size=settings.batch_size,
            lr=settings.lr,
            momentum=settings.momentum,
            seed=self.seed_base + task.round,
            device=self.device,
            prox_mu=0.0 if prepare is not None else settings.prox_mu,  # a whole-model term has no per-sample gradient
            work=settings.work,
            prepare=prepare,
        )
        epsilon = None
        if self.budget is not None and spent is not None:
            self.budget.spend(spent(), settings)
            epsilon = self.budget.epsilon
        return TrainResult(arrays=to_arrays(model), samples=outcome.samples, loss=outcome.loss, epsilon=epsilon)


def encode_update(
    task: RoundTask,
    change: NamedArrays,
    result: TrainResult,
    *,
    base_sha256: str = "",
    local_delta: float | None = None,
) -> bytes:
    """The update's plaintext: the change from the start model (``base_sha256`` when that was not the
    global one) and the metadata the server checks it by."""
    epsilon = result.epsilon if result.epsilon is not None and math.isfinite(result.epsilon) else None
    meta = UpdateMeta(round=task.round, base_version=task.model_version, samples=result.samples, loss=result.loss,
                      base_sha256=base_sha256, local_epsilon=epsilon, local_delta=local_delta, weight=result.weight,
                      local_eval=result.local_eval)  # fmt: skip
    return dumps(change, metadata=meta.to_metadata())
