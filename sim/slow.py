"""Agents on slower hardware, for threshold experiments (``skyfed sim --slow-agents N --slowdown F``).

A slow agent is the real agent daemon whose training takes F times as long as it did: after each
honest round of training it waits (F − 1) × the time training took, as a device F times slower would.
Waiting instead of computing keeps the shared CPU free, so the other agents' timings stay honest. The
first training in a process also pays one-off start-up costs (PyTorch's lazy initialisation, seconds
on a busy machine) that are not compute a slower device would multiply: that round, a second, warm
training (the same seeded computation, same result) is timed and only its time is slowed.
"""

from __future__ import annotations

import time

from flcore.update import TrainResult
from models.weights import NamedArrays
from participant.trainer import PeerContext, Trainer, TrainerWrapper
from protocol.messages import RoundTask


class SlowTrainer(TrainerWrapper):
    """Wraps a trainer; each ``train`` takes ``slowdown`` times as long in wall-clock."""

    def __init__(self, inner: Trainer, slowdown: float) -> None:
        if slowdown < 1:
            raise ValueError(f"--slowdown must be >= 1, got {slowdown}")
        super().__init__(inner)
        self.slowdown = slowdown
        self.warm = False

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        result, seconds = self._timed(global_arrays, task, context)
        if not self.warm:
            self.warm = True
            _, seconds = self._timed(global_arrays, task, context)
            time.sleep(max(0.0, (self.slowdown - 2) * seconds))  # the warm run itself was the first extra share
            return result
        time.sleep((self.slowdown - 1) * seconds)
        return result

    def _timed(
        self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None
    ) -> tuple[TrainResult, float]:
        started = time.monotonic()
        result = self.inner.train(global_arrays, task, context)
        return result, time.monotonic() - started
