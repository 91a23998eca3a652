"""Server-side evaluation of a candidate global model on the optional validation set (``server.eval_data``)."""

from __future__ import annotations

from models.datasets import Dataset
from models.training import evaluate
from models.weights import NamedArrays, load_arrays
from models.zoo import build_model, pick_device


class Evaluator:
    """Accuracy and loss of named arrays for one model architecture; builds the model once."""

    def __init__(self, model_name: str, num_classes: int, data: Dataset) -> None:
        self.model = build_model(model_name, num_classes=num_classes)
        self.data = data
        self.device = pick_device()

    def __call__(self, arrays: NamedArrays) -> dict[str, float]:
        load_arrays(self.model, arrays)
        return {k: round(v, 6) for k, v in evaluate(self.model, self.data, self.device).items()}
