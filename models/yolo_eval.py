"""mAP of a detector's named arrays on a YOLO dataset's val split, measured by Ultralytics' ``DetectionValidator``,
and the detector's own val losses from the same pass (``models.yolo_val_loss``).

Both the server (the global model) and benchmarks use this; agents get the same numbers from their
Ultralytics trainer's own validation. The validator fuses Conv+BatchNorm in the model it is given, so
every call builds a fresh model from the arrays and the caller's arrays are never touched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from models.weights import NamedArrays, load_arrays
from models.yolo import prepare_run
from models.yolo_dataset import DatasetError, load_data_yaml
from models.zoo import build_model, pick_device

VAL_BATCH = 16


def map_metrics(results: dict[str, float]) -> dict[str, float]:
    """SkyFed's names for Ultralytics' box metrics (``metrics/mAP50(B)`` → ``map50``, …), rounded."""
    names = {"map50": "metrics/mAP50(B)", "map50_95": "metrics/mAP50-95(B)", "precision": "metrics/precision(B)",
             "recall": "metrics/recall(B)"}  # fmt: skip
    return {ours: round(float(results[theirs]), 6) for ours, theirs in names.items() if theirs in results}


class DetectionEvaluator:
    """mAP@.5, mAP@.5:.95, precision, recall and the box/cls/dfl losses of named arrays of detector
    ``model_name`` on ``data_yaml``'s val split."""

    def __init__(self, model_name: str, data_yaml: Path, *, image_size: int, work_dir: Path) -> None:
        self.data = load_data_yaml(data_yaml)
        if not self.data.val:
            raise DatasetError(f"{data_yaml}: the val split holds no images; the server evaluates on it")
        self.model_name = model_name
        self.image_size = image_size
        self.work_dir = work_dir
        self.yaml = prepare_run(self.data, work_dir, "eval-data.yaml")

    def __call__(self, arrays: NamedArrays) -> dict[str, float]:
        from models.yolo_val_loss import LossKeepingValidator

        validator = LossKeepingValidator(args=self.validator_args())
        results = validator(model=self.fresh_model(arrays))
        shutil.rmtree(self.work_dir / "val", ignore_errors=True)
        return {**map_metrics(results), **validator.losses()}

    def fresh_model(self, arrays: NamedArrays) -> torch.nn.Module:
        """A new detector holding ``arrays``, on the evaluation device in eval mode (the validator fuses it)."""
        model = build_model(self.model_name, num_classes=self.data.num_classes)
        load_arrays(model, arrays)
        model.names = dict(enumerate(self.data.names))
        return model.to(pick_device()).eval()

    def validator_args(self) -> dict:
        """Ultralytics' validator arguments for this dataset (the rest, loss gains included, are its defaults)."""
        return dict(data=str(self.yaml), imgsz=self.image_size, batch=VAL_BATCH, device=pick_device().type,
                    workers=0, plots=False, save_json=False, verbose=False, half=False, project=str(self.work_dir),
                    name="val", exist_ok=True)  # fmt: skip
