"""Ultralytics' ``DetectionValidator`` that also keeps the detector's own loss on each val batch, in the same pass.

Ultralytics adds ``model.loss(batch, preds)`` per batch only when a trainer runs its validator; a standalone
validation (the server's) reports no loss. This validator makes the same call on every batch's raw predictions,
before NMS, with the box/cls/dfl gains of Ultralytics' default config (the validator's own ``args``, as the
trainer attaches its own), and returns the mean per batch as the trainer's ``val/box_loss`` … would be.
Import it only after ``models.yolo.ultralytics_offline`` (``prepare_run``): it imports Ultralytics.
"""

from __future__ import annotations

from typing import Any

import torch
from ultralytics.models.yolo.detect import DetectionValidator

LOSS_KEYS = ("box_loss", "cls_loss", "dfl_loss")  # a DFL-free head (reg_max 1) names an l1_loss, left out


class LossKeepingValidator(DetectionValidator):
    """``DetectionValidator`` whose ``losses()`` gives the mean box/cls/dfl loss per val batch after a call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.detector: torch.nn.Module | None = None
        self.batch: dict[str, Any] = {}
        self.sums: dict[str, float] = {}
        self.batches = 0

    def __call__(self, trainer: Any = None, model: torch.nn.Module | None = None, **kwargs: Any) -> dict:
        """Validate ``model``, a ``DetectionModel``, keeping its loss; under a trainer, as Ultralytics does."""
        self.detector, self.sums, self.batches = (model if trainer is None else None), {}, 0
        if self.detector is not None:
            self.detector.args = self.args  # the loss gains, attached as Ultralytics' trainer attaches its own
        return super().__call__(trainer=trainer, model=model, **kwargs)

    def preprocess(self, batch: dict[str, Any]) -> dict[str, Any]:
        self.batch = super().preprocess(batch)
        return self.batch

    def postprocess(self, preds: Any) -> list[dict[str, torch.Tensor]]:
        """NMS as Ultralytics does, after adding the batch's loss from the raw head outputs (a Detect head in
        eval mode gives ``(boxes, raw)``; ``AutoBackend`` passes that on as a list)."""
        if self.detector is not None:
            raw = preds[1] if isinstance(preds, (list, tuple)) else preds
            for key, value in self.detector.loss(self.batch, raw)[1].items():
                self.sums[key] = self.sums.get(key, 0.0) + float(value)
            self.batches += 1
        return super().postprocess(preds)

    def losses(self) -> dict[str, float]:
        """The mean of each of ``LOSS_KEYS`` over the batches of the last call, ``{}`` before any; to 6 significant
        digits, as a loss has no fixed scale (an untrained detector's box loss is near 1e-13)."""
        return {key: float(f"{self.sums[key] / self.batches:.6g}") for key in LOSS_KEYS if key in self.sums}
