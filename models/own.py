"""The operator's own classifier and data loader, named ``"package.module:function"`` in their own config
(docs/own-model.md).

A model builder is called as ``build(num_classes=N)`` and returns a ``torch.nn.Module``; its module states
the per-sample input shape as ``INPUT_SHAPE`` (e.g. ``(1, 8, 8)``), which ONNX export, evaluation and the
data checks need. A data loader is called as ``load(path)`` with the resolved ``agent.data`` (or
``agent.test_data``) path and returns ``(x, y)`` or a ``models.datasets.Dataset``: ``x`` a float array
``(N, *INPUT_SHAPE)``, ``y`` integer labels ``(N,)``.

A detector of the operator's own is named by its file instead (``models.tasks.is_model_file``): an
Ultralytics model ``.yaml``, or a ``.pt`` checkpoint (a pickle: loading it runs code too).

Importing a module runs its code: a trust boundary. Only names from the operator's own config files (and
``skyfed sim --model``) are resolved here; a name that came over MQTT (a round task's ``model``) is never
imported — an agent builds the model its own config names and refuses a task naming another.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from models.datasets import Dataset
from models.tasks import is_model_file

_REFERENCE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def is_reference(name: str) -> bool:
    """Whether ``name`` names the operator's own function (``package.module:function``), not a zoo model."""
    return ":" in name


def model_refusal(task_model: str, own_model: str) -> str:
    """Why an agent whose own config names ``own_model`` ("" = zoo models only) must not build a round task's
    ``task_model`` (``""`` when it may): the trust boundary, checked before anything imports the task's name."""
    if own_model and task_model != own_model:
        return f"model-mismatch: the round task names {task_model}, this agent's config {own_model}"
    if (is_reference(task_model) or is_model_file(task_model)) and not own_model:
        return (f"model-mismatch: the round task names the custom model {task_model}; this agent builds only a "
                "model its own config names: set training.model to it")  # fmt: skip
    return ""


def resolve(reference: str, key: str) -> Callable[..., Any]:
    """The function ``reference`` names; a ``ValueError`` naming ``key`` and the fix when it cannot be had."""
    where = f"{key} = {reference!r}"
    if not _REFERENCE.match(reference):
        raise ValueError(f'{where}: expected "package.module:function" (a Python module path, a colon, a name)')
    module_name, attribute = reference.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure of the operator's code is reported, not raised
        raise ValueError(f"{where}: module {module_name!r} cannot be imported ({type(exc).__name__}: {exc}); "
                         "put its folder on PYTHONPATH or install it") from None  # fmt: skip
    if not hasattr(module, attribute):
        raise ValueError(f"{where}: module {module_name!r} has no attribute {attribute!r}; define it there")
    function = getattr(module, attribute)
    if not callable(function):
        raise ValueError(f"{where}: {attribute!r} in {module_name!r} is a {type(function).__name__}, not a function")
    return function


def build_own_model(reference: str, num_classes: int, key: str = "model") -> Any:
    """``build(num_classes=N)`` of the operator's module, checked to be a ``torch.nn.Module``."""
    from torch import nn

    built = resolve(reference, key)(num_classes=num_classes)
    if not isinstance(built, nn.Module):
        raise ValueError(f"{key} = {reference!r}: returned a {type(built).__name__}, not a torch.nn.Module; "
                         "return the model (e.g. return MyNet(num_classes))")  # fmt: skip
    return built


def own_input_shape(reference: str, key: str = "model") -> tuple[int, ...]:
    """The per-sample input shape the builder's module states as ``INPUT_SHAPE``."""
    module_name = reference.split(":")[0]
    resolve(reference, key)
    shape = getattr(importlib.import_module(module_name), "INPUT_SHAPE", None)
    if (not isinstance(shape, (tuple, list)) or not shape
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):  # fmt: skip
        raise ValueError(f"{key} = {reference!r}: module {module_name!r} must state the per-sample input shape, "
                         f"e.g. INPUT_SHAPE = (1, 8, 8); got {shape!r}")  # fmt: skip
    return tuple(shape)


def check_own_model(reference: str, num_classes: int, key: str) -> tuple[int, ...]:
    """Build the model once and run a batch of zeros through it: what a bad builder does shows at start,
    naming ``key``. Returns its per-sample input shape."""
    import torch

    shape = own_input_shape(reference, key)
    model = build_own_model(reference, num_classes, key)
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros((2, *shape)))
    except Exception as exc:  # noqa: BLE001 - the operator's forward() may raise anything
        raise ValueError(f"{key} = {reference!r}: a batch of shape (2, *INPUT_SHAPE={shape}) fails in forward() "
                         f"({type(exc).__name__}: {exc}); make INPUT_SHAPE what the model takes") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{key} = {reference!r}: forward() must return logits of shape (batch, num_classes) = "
                         f"(2, {num_classes}), got {got}")  # fmt: skip
    return shape


def load_own_data(reference: str, path: Path, key: str) -> Dataset:
    """``load(path)`` of the operator's loader, checked: equal-length ``x`` (float) and ``y`` (integer labels
    >= 0), at least one sample, all finite. ``x`` is cast to float32 and ``y`` to int64."""
    result = resolve(reference, key)(path)
    if isinstance(result, Dataset):
        x, y = result.x, result.y
    elif isinstance(result, tuple) and len(result) == 2:
        x, y = (np.asarray(part) for part in result)
    else:
        raise ValueError(f"{key} = {reference!r}: load(path) returned a {type(result).__name__}; return (x, y) "
                         "numpy arrays or a models.datasets.Dataset")  # fmt: skip
    if x.ndim < 2 or not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"{key} = {reference!r}: x must be a numeric array (N, *sample_shape), got {x.dtype} "
                         f"{x.shape}")  # fmt: skip
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{key} = {reference!r}: y must hold integer class labels, got {y.dtype}")
    if len(y) == 0:
        raise ValueError(f"{key} = {reference!r}: load(path) returned no samples")
    try:
        return Dataset(x.astype(np.float32, copy=False), y.astype(np.int64, copy=False))
    except ValueError as exc:
        raise ValueError(f"{key} = {reference!r}: {exc}") from None
