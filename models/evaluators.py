"""Evaluating named arrays on a validation set, by the model's task: accuracy and loss on an ``.npz`` for
classifiers; mAP@.5 and mAP@.5:.95 from Ultralytics' own ``DetectionValidator`` on a YOLO ``data.yaml``'s
val split for detectors. The server evaluates on ``server.eval_data`` (``broker_server.rounds.evaluation``), a
peer on its local validation split (``agent.peer``); ``protocol.messages.headline`` is the one number
models are compared by (election, logs, tables).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from models.datasets import load_dataset
from models.own import is_reference
from models.tasks import task_of
from models.training import evaluate
from models.weights import NamedArrays, load_arrays
from models.zoo import build_model, pick_device

Evaluator = Callable[[NamedArrays], dict[str, float]]


class ClassifierEvaluator:
    """Accuracy and loss of named arrays for one model architecture; builds the model once."""

    def __init__(self, model_name: str, num_classes: int, data_path: Path) -> None:
        self.model = build_model(model_name, num_classes=num_classes)
        # channels-last convolutions: the digits CNN scores the 360-sample test set in 3.8 instead of 6-8 ms on one
        # core, and a server scores up to ``server.score_trained`` + 2 models a round (docs/results/scale.md); an
        # operator's own model keeps its layout, since its code may ``view`` its activations
        if not is_reference(model_name):
            self.model.to(memory_format=torch.channels_last)
        self.data = load_dataset(data_path)
        self.device = pick_device()

    def __call__(self, arrays: NamedArrays) -> dict[str, float]:
        load_arrays(self.model, arrays)
        return {k: round(v, 6) for k, v in evaluate(self.model, self.data, self.device).items()}


def build_evaluator(
    model_name: str, num_classes: int, data_path: Path, *, image_size: int, work_dir: Path
) -> Evaluator:
    """The evaluator for ``model_name``'s task on the data at ``data_path``."""
    if task_of(model_name) == "detect":
        from models.yolo_eval import DetectionEvaluator

        return DetectionEvaluator(model_name, data_path, image_size=image_size, work_dir=work_dir)
    return ClassifierEvaluator(model_name, num_classes, data_path)
