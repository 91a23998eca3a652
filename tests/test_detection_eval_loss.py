"""The server's detector evaluation reports the detector's own val losses from the same pass as its mAP: the
numbers Ultralytics' ``DetectionModel.loss`` gives on the val batch, with mAP exactly as the plain validator's."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models.synthetic_detection import NAMES, write_dataset
from models.weights import to_arrays
from models.yolo_dataset import label_file, load_data_yaml
from models.yolo_eval import DetectionEvaluator, map_metrics
from models.zoo import build_model

SIZE = 64
LOSSES = ("box_loss", "cls_loss", "dfl_loss")
MAPS = ("map50", "map50_95", "precision", "recall")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("det") / "data", train=2, val=4, seed=3, size=SIZE)


def confident_detector() -> torch.nn.Module:
    """An untrained yolo11n whose class scores start at 0.5 (not Ultralytics' prior near 2e-4) and whose box
    distances lean to one stride (not 7.5), so it detects boxes smaller than a 64 px image."""
    torch.manual_seed(1)
    model = build_model("yolo11n", num_classes=len(NAMES))
    for scores, boxes in zip(model.model[-1].cv3, model.model[-1].cv2, strict=True):
        torch.nn.init.zeros_(scores[-1].bias)
        with torch.no_grad():
            boxes[-1].bias.view(4, -1)[:, 1] += 4.0
    return model.eval()


def self_labelled(dataset: Path, root: Path, model: torch.nn.Module) -> Path:
    """A copy of ``dataset`` whose val labels are ``model``'s own top detections, so its mAP and box losses are
    far from 0 and any change to its predictions shows in them."""
    from ultralytics.utils.nms import non_max_suppression

    shutil.copytree(dataset.parent, root, ignore=shutil.ignore_patterns("*.cache"))
    for image in load_data_yaml(root / "data.yaml").val:
        pixels = torch.from_numpy(np.asarray(Image.open(image).convert("RGB"), np.float32) / 255)
        with torch.no_grad():
            found = non_max_suppression(model(pixels.permute(2, 0, 1)[None])[0], 0.001, 0.7, max_det=5)[0]
        lines = []
        for x0, y0, x1, y1, c in torch.cat((found[:, :4].clamp(0, SIZE) / SIZE, found[:, 5:6]), 1).tolist():
            if x1 > x0 and y1 > y0:
                lines.append(f"{int(c)} {(x0 + x1) / 2:.6f} {(y0 + y1) / 2:.6f} {x1 - x0:.6f} {y1 - y0:.6f}\n")
        label_file(image).write_text("".join(lines))
    return root / "data.yaml"


def test_the_evaluation_reports_finite_positive_losses_on_the_synthetic_set(dataset, tmp_path):
    torch.manual_seed(1)
    evaluation = DetectionEvaluator("yolo11n", dataset, image_size=SIZE, work_dir=tmp_path)(
        to_arrays(build_model("yolo11n", num_classes=len(NAMES))))  # fmt: skip
    assert set(LOSSES) <= set(evaluation)
    assert all(math.isfinite(evaluation[k]) and evaluation[k] > 0 for k in LOSSES), evaluation


def test_the_losses_are_the_models_own_on_the_val_batch_and_leave_map_unchanged(dataset, tmp_path):
    from ultralytics.models.yolo.detect import DetectionValidator

    model = confident_detector()
    arrays = to_arrays(model)
    data = self_labelled(dataset, tmp_path / "data", model)
    evaluator = DetectionEvaluator("yolo11n", data, image_size=SIZE, work_dir=tmp_path / "eval")
    evaluation = evaluator(arrays)

    plain = DetectionValidator(args=evaluator.validator_args())
    assert map_metrics(plain(model=evaluator.fresh_model(arrays))) == {k: evaluation[k] for k in MAPS}
    assert all(evaluation[k] > 0 for k in MAPS), evaluation  # numbers that any change to the predictions would move

    # the 4 val images are one batch: its mean loss is the unfused model's own loss on that batch
    batch = plain.preprocess(next(iter(plain.dataloader)))
    unfused = evaluator.fresh_model(arrays)
    unfused.args = plain.args  # Ultralytics' default loss gains, as its trainer attaches them
    own = {k: float(v) for k, v in unfused.loss(batch)[1].items()}
    assert set(own) == set(LOSSES) and all(own[k] > 0.01 for k in LOSSES), own
    assert {k: evaluation[k] for k in LOSSES} == pytest.approx(own, rel=1e-3)
