"""Local trainers: the plug-in point between a round task and a model update, for every participant
(the edge agent, a peer, the server's shared-pool trainer).

A trainer owns its data, gets the global weights (named arrays) and the round's settings, and returns
new weights plus what the server weighs them by. ``training.trainer`` in ``agent.toml`` picks one:
``classifier`` (``ClassifierTrainer``: the PyTorch CNNs and MLPs on an ``.npz``) or ``detector``
(``participant.detector.DetectorTrainer``: Ultralytics YOLO on a YOLO ``data.yaml``). Trainers run where
PyTorch is: the agent's training child (``agent.training_child``), or a simulation's host process.
Whether the agent *can* train a task's model is the daemon's light decision (``agent.profile``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flcore.update import TrainResult
from models.weights import NamedArrays
from participant.local_dp import PrivacyBudget
from protocol.messages import RoundTask


@dataclass(frozen=True)
class PeerContext:
    """What a trainer gets besides its start model under FedAMN (seed 003): its cluster mates' models (``peers``:
    each float tensor stacked over the models, ``flcore.agent_models.peer_bundle``) and the global
    model's float tensors, for the attention meta-network (``participant.meta_attention``)."""

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
