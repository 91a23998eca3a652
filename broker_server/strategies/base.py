"""The strategy interface the round engine drives.

A round is ``begin`` → ``accumulate`` once per accepted update → ``finalize``. Updates arrive already
validated (``broker_server.validation``), as flat float32 deltas over the global model's floating
tensors, so a strategy is only arithmetic. A strategy may keep a running sum (FedAvg: memory
independent of the number of agents) or a bounded store of every update (swapping, clustering), and
may return a different model per agent (``RoundResult.per_agent``). ``state``/``restore`` let the
server checkpoint a round in progress, so a restart loses no accepted update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

NamedArrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class AcceptedUpdate:
    """One validated update: a flat float32 delta (read-only view) and what the agent reported."""

    agent: str
    delta: np.ndarray
    samples: int
    loss: float


@dataclass(frozen=True)
class RoundResult:
    """The new global float vector, and optionally a personal model per agent (for their inboxes)."""

    global_vector: np.ndarray
    per_agent: dict[str, np.ndarray] = field(default_factory=dict)


class Strategy(ABC):
    """Base class: override the steps your method changes."""

    name: str = ""

    @abstractmethod
    def begin(self, global_vector: np.ndarray) -> None:
        """Start a round from the current global float vector (read-only)."""

    @abstractmethod
    def accumulate(self, update: AcceptedUpdate) -> None:
        """Fold in one accepted update; the delta view is only valid during this call."""

    @abstractmethod
    def finalize(self) -> RoundResult:
        """Combine what was accumulated into the next global model."""

    @abstractmethod
    def state(self) -> NamedArrays:
        """Arrays that capture the round in progress (for the checkpoint)."""

    @abstractmethod
    def restore(self, global_vector: np.ndarray, state: NamedArrays) -> None:
        """Resume a round in progress from ``state()`` output."""
