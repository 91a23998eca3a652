"""Mixed precision for the YOLO trainer (``[training] amp = true``), with its loss scale kept across rounds.

Why: fp16 training multiplies the loss by a scale so that small gradients do not flush to zero. PyTorch's
``GradScaler`` starts at 2¹⁶, halves the scale *and skips the optimizer step* whenever a gradient
overflows, and grows it again only after 2,000 clean steps. A trainer built every round starts at 2¹⁶
every round: on an H100 a 12-step YOLO round skipped 7–8 steps finding the scale anew (docs/results/edge_agent.md).
Keeping the scaler's state makes each round start at the last round's scale, as one long run would.

Ultralytics itself is run with ``amp=False``: its own AMP switch first runs ``check_amp``, which loads
(and downloads) a hub checkpoint to compare fp16 with fp32 — a network call every round. These
callbacks turn mixed precision on after Ultralytics built its disabled scaler, with the kept state.

The state is ``<work_dir>/grad_scaler.json``: the scaler's ``state_dict``, tagged with the model (another
model starts from PyTorch's default). A scale that is not a positive finite number is never kept.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from common.files import read_json, write_json

log = logging.getLogger("skyfed.agent")

SCALER_FILE = "grad_scaler.json"
# the keys of GradScaler.state_dict() of an enabled scaler
STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def valid_state(state: object) -> bool:
    """A GradScaler ``state_dict`` with a usable scale."""
    if not isinstance(state, dict) or set(state) != set(STATE_KEYS):
        return False
    numbers = all(isinstance(state[k], (int, float)) and not isinstance(state[k], bool) for k in STATE_KEYS)
    return numbers and math.isfinite(state["scale"]) and state["scale"] > 0


class ScalerStore:
    """The loss-scaler state this agent kept after its last mixed-precision round."""

    def __init__(self, work_dir: Path) -> None:
        self.path = work_dir / SCALER_FILE

    def start(self, model: str) -> dict[str, Any]:
        """The kept state for ``model``, or ``{}`` (PyTorch's default start)."""
        if not self.path.exists():
            return {}
        try:
            kept = read_json(self.path)
        except (OSError, ValueError) as exc:
            log.warning("amp: %s unreadable (%s); the loss scale starts from the default", self.path, exc)
            return {}
        state = kept.get("state") if isinstance(kept, dict) and kept.get("model") == model else None
        return state if valid_state(state) else {}

    def keep(self, model: str, state: dict[str, Any]) -> None:
        if valid_state(state):
            write_json(self.path, {"model": model, "state": state})
        else:
            self.path.unlink(missing_ok=True)


class MixedPrecision:
    """Ultralytics trainer callbacks: fp16 autocast with the kept scaler, and a count of skipped steps
    (a step the scaler skips is one whose scale it lowered)."""

    def __init__(self, store: ScalerStore, model: str) -> None:
        self.store = store
        self.model = model
        self.steps = self.skipped = 0
        self.first_scale = self.scale = 0.0

    def attach(self, trainer: Any) -> None:
        trainer.add_callback("on_pretrain_routine_end", self.on_pretrain_routine_end)
        trainer.add_callback("on_train_batch_end", self.on_train_batch_end)

    def on_pretrain_routine_end(self, trainer: Any) -> None:
        if trainer.device.type != "cuda":
            return  # fp16 autocast is for CUDA (config refuses amp on "cpu"; "auto" may find no GPU)
        trainer.amp = True  # read by the training loop (autocast) and the validator (fp16 inputs)
        trainer.scaler = torch.amp.GradScaler("cuda")
        if kept := self.store.start(self.model):
            trainer.scaler.load_state_dict(kept)
        self.first_scale = self.scale = trainer.scaler.get_scale()

    def on_train_batch_end(self, trainer: Any) -> None:
        if not trainer.amp:
            return
        scale = trainer.scaler.get_scale()
        self.steps += 1
        self.skipped += scale < self.scale
        self.scale = scale

    def finish(self, trainer: Any, round_number: int) -> None:
        """Keep the scaler's state for the next round and log what this round's scale did."""
        if not trainer.amp:
            return
        self.store.keep(self.model, trainer.scaler.state_dict())
        log.info("amp round=%d scale=%g..%g skipped_steps=%d of %d", round_number, self.first_scale, self.scale,
                 self.skipped, self.steps)  # fmt: skip
