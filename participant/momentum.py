"""An agent's SGD momentum carried from one round to the next (``[training] keep_momentum``).

Why: a trainer builds a fresh optimizer every round, so momentum starts from zero. With β = 0.9 the
k-th step of a round moves (1 − βᵏ)/(1 − β) gradients' worth, so a 6-step round moves 17.8 gradients'
worth where steady momentum would move 60: short rounds (few images per agent) waste most of their
steps (docs/results/detection.md). Keeping each agent's momentum buffers lets its SGD continue across
rounds as one run would; the buffers are the agent's own (never sent).

The buffers live in ``<work_dir>/momentum.safetensors`` (parameter name → buffer), tagged with the
run id and the model: a new run, another model or a parameter of another shape starts from zero.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from models.serialization import SerializationError, load_file, save_file
from models.weights import NamedArrays
from protocol.messages import RoundTask, TrainSettings

log = logging.getLogger("skyfed.agent")

MOMENTUM_FILE = "momentum.safetensors"


class MomentumStore:
    """The momentum buffers this agent kept after its last round, for the next one's optimizer."""

    def __init__(self, work_dir: Path) -> None:
        self.path = work_dir / MOMENTUM_FILE

    def start(self, task: RoundTask, settings: TrainSettings) -> NamedArrays:
        """The kept buffers if ``settings`` keep momentum and they are of ``task``'s run and model, else none."""
        if not settings.keep_momentum or not self.path.exists():
            return {}
        try:
            buffers, meta = load_file(self.path)
        except (OSError, SerializationError) as exc:
            log.warning("momentum: %s unreadable (%s); starting from zero", self.path, exc)
            return {}
        if meta.get("run_id") != task.run_id or meta.get("model") != task.model:
            return {}
        return buffers

    def keep(self, task: RoundTask, settings: TrainSettings, buffers: NamedArrays) -> None:
        """Store ``buffers`` for the next round (nothing when ``settings`` do not keep momentum). Non-finite
        buffers (a diverged round) are dropped, so one bad round does not poison every later one."""
        if not settings.keep_momentum:
            return
        if not all(np.isfinite(b).all() for b in buffers.values()):
            log.warning("momentum: non-finite after round %d; the next round starts from zero", task.round)
            self.path.unlink(missing_ok=True)
            return
        save_file(self.path, buffers, {"run_id": task.run_id, "model": task.model})
