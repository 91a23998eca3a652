"""Local trainers: the plug-in point between a round task and a model update.

A trainer gets the global weights (named arrays) and the round's settings and returns new weights
plus what the server weighs them by. ``ClassifierTrainer`` covers the PyTorch CNNs and MLPs; an
Ultralytics YOLO trainer will implement the same ``Trainer`` protocol.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Protocol

import torch

from agent.local_dp import PrivacyBudget, dp_sgd
from models.datasets import Dataset
from models.serialization import dumps
from models.training import train_sgd
from models.weights import NamedArrays, load_arrays, to_arrays
from models.zoo import build_model
from protocol.messages import RoundTask
from protocol.update import UpdateMeta


@dataclass(frozen=True)
class TrainResult:
    arrays: NamedArrays
    samples: int
    loss: float
    epsilon: float | None = None  # this agent's own DP-SGD epsilon after the round (local DP only)


class Trainer(Protocol):
    def train(self, global_arrays: NamedArrays, task: RoundTask) -> TrainResult: ...


class ClassifierTrainer:
    """SGD with momentum on this agent's dataset, with the round's epochs, batch size and learning rate."""

    def __init__(
        self, data: Dataset, *, device: torch.device, agent_id: str, seed: int = 0, budget: PrivacyBudget | None = None
    ) -> None:
        self.data = data
        self.device = device
        self.agent_id = agent_id
        self.seed_base = seed * 1_000_003 + zlib.crc32(agent_id.encode())
        self.budget = budget  # DP-SGD (agent.local_dp) when given

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
                      base_sha256=base_sha256, local_epsilon=epsilon, local_delta=local_delta)  # fmt: skip
    return dumps(change, metadata=meta.to_metadata())
