"""The model zoo: the PyTorch models SkyFed federates, built from code (nothing downloaded).

``build_model(name)`` is what configs and round tasks refer to; a ``package.module:function`` name is the
operator's own classifier (``models.own``: resolve such a name only from the operator's own config). Each
model has a ``task``: ``classify``
(the PyTorch CNNs and MLPs of ``models.networks``) or ``detect`` (Ultralytics YOLO, built from its ``.yaml`` by
``models.yolo``, imported only when such a model is built).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from models.own import build_own_model, is_reference, own_input_shape
from models.tasks import YOLO_YAMLS, is_model_file

if TYPE_CHECKING:
    import torch
    from torch import nn

    from models.weights import NamedArrays


@dataclass(frozen=True)
class ModelSpec:
    name: str
    input_shape: tuple[int, ...]  # per sample; detectors take any multiple of 32 (``TrainSettings.image_size``)
    factory: Callable[[int], nn.Module]


DETECTOR_INPUT = (3, 640, 640)  # any multiple of 32 works (``TrainSettings.image_size``); ONNX exports take this
THESIS_MLP_HIDDEN = (256, 128, 64)  # seed 004's MLP: Flatten → 256 → 128 → 64 → classes, ReLU, no BatchNorm


def _network(name: str, *args: object) -> Callable[[int], nn.Module]:
    """The factory of ``models.networks.<name>(*args, num_classes=…)``, importing PyTorch only when it builds."""

    def build(num_classes: int) -> nn.Module:
        from models import networks

        return getattr(networks, name)(*args, num_classes=num_classes)

    return build


def _yolo(name: str) -> ModelSpec:
    def build(num_classes: int) -> nn.Module:
        from models.yolo import detection_model

        return detection_model(name, num_classes)

    return ModelSpec(name, DETECTOR_INPUT, build)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("fedavg_cnn", (1, 28, 28), _network("FedAvgCNN")),
        ModelSpec("digits_cnn", (1, 8, 8), _network("DigitsCNN")),
        ModelSpec("mlp_digits", (1, 8, 8), _network("MLP", 64, (64,))),
        ModelSpec("mlp_mnist", (1, 28, 28), _network("MLP", 784, (200, 200))),
        ModelSpec("mnist1d_cnn", (1, 40), _network("Mnist1dCNN")),
        ModelSpec("thesis_mlp_digits", (1, 8, 8), _network("MLP", 64, THESIS_MLP_HIDDEN)),
        ModelSpec("thesis_cnn_digits", (1, 8, 8), _network("ThesisCNN", 2, 8)),
        ModelSpec("thesis_mlp_mnist1d", (1, 40), _network("MLP", 40, THESIS_MLP_HIDDEN)),
        ModelSpec("thesis_cnn_mnist1d", (1, 40), _network("ThesisCNN", 1, 40)),
        *(_yolo(name) for name in YOLO_YAMLS),
    )
}


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"model {name!r} is unknown; choose one of {sorted(MODELS)}") from None


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    if is_model_file(name):  # the operator's own detector (models.tasks.is_model_file)
        from models.yolo import detection_model

        return detection_model(name, num_classes)
    if is_reference(name):
        return build_own_model(name, num_classes)
    return _spec(name).factory(num_classes)


def initial_model(name: str, num_classes: int, seed: int, weights: Path | None = None) -> NamedArrays:
    """A run's first model, alike wherever it is built (the server's first global model, every peer's start):
    seeded, or loaded from the detector checkpoint ``weights``."""
    import torch

    from models.weights import to_arrays
    from models.yolo import load_pt_weights

    torch.manual_seed(seed)
    built = build_model(name, num_classes=num_classes)
    if weights is not None:
        load_pt_weights(built, weights)
    return to_arrays(built)


def input_shape(name: str) -> tuple[int, ...]:
    """The per-sample input shape of model ``name``, e.g. (1, 8, 8)."""
    if is_model_file(name):
        return DETECTOR_INPUT
    return own_input_shape(name) if is_reference(name) else _spec(name).input_shape


def pick_device() -> torch.device:
    """CUDA when present (Jetson, workstation), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
