"""Local trainers: the plug-in point between a round task and a model update.

A trainer owns its data, gets the global weights (named arrays) and the round's settings, and returns
new weights plus what the server weighs them by. ``training.trainer`` in ``agent.toml`` picks one:
``classifier`` (``ClassifierTrainer``: the PyTorch CNNs and MLPs on an ``.npz``) or ``detector``
(``agent.detector.DetectorTrainer``: Ultralytics YOLO on a YOLO ``data.yaml``). Trainers run where
PyTorch is: the agent's training child (``agent.training_child``), or a simulation's host process.
Whether the agent *can* train a task's model is the daemon's light decision (``agent.profile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from agent.local_dp import PrivacyBudget, budget_for
from models.datasets import load_dataset
from models.serialization import dumps
from models.weights import NamedArrays, delta
from protocol.codecs import Codec, ErrorFeedback, compress
from protocol.messages import RoundTask
from protocol.update import UpdateMeta

if TYPE_CHECKING:
    import torch

    from agent.config import AgentConfig


@dataclass(frozen=True)
class TrainResult:
    arrays: NamedArrays
    samples: int
    loss: float
    epsilon: float | None = None  # this agent's own DP-SGD epsilon after the round (local DP only)
    weight: int = 0  # what the server weighs the update by (0: ``samples``); detectors: annotated objects
    local_eval: dict[str, float] = field(default_factory=dict)  # the trainer's own validation, e.g. map50
    start_eval: dict[str, float] = field(default_factory=dict)  # the start model on the local test split (C-SPE)


@dataclass(frozen=True)
class PeerContext:
    """What a trainer gets besides its start model under FedAMN (seed 003): its cluster mates' models (``peers``:
    each float tensor stacked over the models, ``broker_server.agent_models.peer_bundle``) and the global
    model's float tensors, for the attention meta-network (``agent.meta_attention``)."""

    peers: NamedArrays
    global_model: NamedArrays

    def to_arrays(self) -> NamedArrays:
        """One flat set of named arrays (a file for the training child): ``peers.<name>``, ``global.<name>``."""
        peers = {f"peers.{name}": array for name, array in self.peers.items()}
        return peers | {f"global.{name}": array for name, array in self.global_model.items()}

    @classmethod
    def from_arrays(cls, arrays: NamedArrays) -> PeerContext:
        parts: dict[str, NamedArrays] = {"peers": {}, "global": {}}
        for name, array in arrays.items():
            part, _, tensor = name.partition(".")
            parts[part][tensor] = array
        return cls(parts["peers"], parts["global"])


class TrainingDeclined(Exception):
    """The trainer will not train this round (local DP: it would pass the agent's epsilon budget)."""


class Trainer(Protocol):
    budget: PrivacyBudget | None

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        """Train ``task`` from ``global_arrays`` (the start model); ``context``: FedAMN's other models."""


class TrainerWrapper:
    """Base of trainers that change what another one does (sim attacks and slowness, tests): everything but
    what a subclass overrides is the inner trainer's."""

    def __init__(self, inner: Trainer) -> None:
        self.inner = inner

    @property
    def budget(self) -> PrivacyBudget | None:
        return self.inner.budget

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        return self.inner.train(global_arrays, task, context)


def build_trainer(config: AgentConfig, device: torch.device) -> Trainer:
    """The trainer ``training.trainer`` names, with its data loaded (imports PyTorch: call it where training runs)."""
    if config.training.trainer == "detector":
        from agent.detector import DetectorTrainer

        return DetectorTrainer(config.data_path, device=device, agent_id=config.agent.id, work_dir=config.detector_dir,
                               seed=config.agent.seed, amp=config.training.amp)  # fmt: skip
    from agent.classifier import ClassifierTrainer

    data = load_dataset(config.data_path)
    budget = budget_for(config.privacy, config.state_dir, len(data))
    test = load_dataset(path) if (path := config.test_data_path) is not None else None
    return ClassifierTrainer(data, device=device, agent_id=config.agent.id, work_dir=config.state_dir,
                             seed=config.agent.seed, budget=budget, test_data=test)  # fmt: skip


def encode_update(
    task: RoundTask,
    base: NamedArrays,
    result: TrainResult,
    *,
    residual: Path,
    base_sha256: str = "",
    local_delta: float | None = None,
) -> tuple[bytes, NamedArrays]:
    """The update's plaintext: the change from the start model ``base`` (``base_sha256`` when that was not the
    global one) in the round's codec (``protocol.codecs``; top-k keeps what it did not send in ``residual``,
    for later rounds), with the metadata the server checks it by; and the float32 change the server will
    decode from it (the agent's own model after the round is ``base`` plus that, bit for bit)."""
    codec = Codec.parse(task.codec)
    out = compress(delta(result.arrays, base), codec, ErrorFeedback(residual, task.run_id))
    epsilon = result.epsilon if result.epsilon is not None and math.isfinite(result.epsilon) else None
    meta = UpdateMeta(round=task.round, base_version=task.model_version, samples=result.samples, loss=result.loss,
                      base_sha256=base_sha256, local_epsilon=epsilon, local_delta=local_delta, weight=result.weight,
                      local_eval=result.local_eval, start_eval=result.start_eval, codec=str(codec))  # fmt: skip
    return dumps(out.payload, metadata=meta.to_metadata()), out.sent
