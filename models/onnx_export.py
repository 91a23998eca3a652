"""Export a federated model to a self-describing ONNX file that edge devices run with onnxruntime alone.

The file carries its own metadata (format tag ``models.tasks.ONNX_FORMAT``, task, class names, input shape), so
``agent.infer`` needs nothing else. A file is only published after onnxruntime reproduced PyTorch on seeded
inputs; it must never replace a good file with an unchecked one, never modify the caller's model, and never
raise because a model fails to export (the report says why; the caller logs it).
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from models.tasks import ONNX_FORMAT, TASKS

OPSET = 18
TOLERANCE = 1e-4
CHECK_SAMPLES = 3
SEED = 0
# torch.onnx.export keeps process-wide state (GLOBALS.in_onnx_export): two threads exporting at once (agents
# hosted together, `--agents-per-process`) trip its assertions, so exports take turns
EXPORT_LOCK = threading.Lock()


class ExportError(Exception):
    """A check of this module failed (as opposed to an exception of the exporter or onnxruntime)."""


@dataclass(frozen=True)
class ExportReport:
    ok: bool
    path: Path | None  # the published file, None when nothing was written
    max_abs_diff: float  # onnxruntime vs PyTorch over the check inputs (inf when the check never ran)
    seconds: float
    reason: str  # empty when ok


def export_onnx(
    model: nn.Module, path: Path, *, task: str, input_shape: tuple[int, ...], names: Sequence[str]
) -> ExportReport:
    """Export ``model`` (per-sample ``input_shape``, e.g. (1, 8, 8) or (3, 96, 96)) to ``path``, atomically.

    ``classify``: logits ``(batch, classes)``, dynamic batch. ``detect``: an Ultralytics DetectionModel with its
    head in export mode, output ``(1, 4 + nc, anchors)``, boxes xywh in input pixels, static batch 1.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    start = time.perf_counter()
    path = Path(path)
    tmp: Path | None = None
    diff = float("inf")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        prepared = _prepare_detect(model) if task == "detect" else _prepare(model)
        batch = 1 if task == "detect" else 2
        with EXPORT_LOCK:
            _write(prepared, tmp, task, tuple(input_shape), list(names))
        diff = max_abs_diff(prepared, tmp, tuple(input_shape), batch, task)
        if not diff <= TOLERANCE:  # also catches NaN
            raise ExportError(f"onnxruntime differs from PyTorch by {diff:.3g} (> {TOLERANCE:g})")
        os.replace(tmp, path)
    except Exception as exc:  # any exporter/onnxruntime failure is a report, not a crash of the caller
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        reason = (str(exc) if isinstance(exc, ExportError) else f"{type(exc).__name__}: {exc}").splitlines()[0]
        return ExportReport(False, None, diff, time.perf_counter() - start, reason)
    return ExportReport(True, path, diff, time.perf_counter() - start, "")


def _prepare(model: nn.Module) -> nn.Module:
    """A private fp32 CPU eval copy: exporting must not change the model that keeps training."""
    prepared = copy.deepcopy(model).float().cpu().eval()
    for p in prepared.parameters():
        p.requires_grad_(False)
    return prepared


def _prepare_detect(model: nn.Module) -> nn.Module:
    """Put a copy in the state Ultralytics' exporter uses: BN fused, Detect emitting only its decoded
    ``(B, 4 + nc, anchors)`` tensor (xywh, no NMS, no end-to-end top-k), C2f split for a cleaner graph."""
    from models.yolo import ultralytics_offline

    ultralytics_offline()
    from ultralytics.nn.modules import C2f, Detect

    prepared = _prepare(model)
    if hasattr(prepared, "end2end"):
        prepared.end2end = False  # keep the raw one-to-many output that agent.infer decodes with NMS
    if hasattr(prepared, "fuse"):
        prepared = prepared.fuse(verbose=False)
    heads = [m for m in prepared.modules() if isinstance(m, Detect)]
    if len(heads) != 1:
        raise ExportError(f"a detect model needs exactly one Ultralytics Detect head, found {len(heads)}")
    for m in prepared.modules():
        if isinstance(m, Detect):
            m.dynamic, m.export, m.format, m.xyxy, m.shape = False, True, "onnx", False, None
        elif isinstance(m, C2f):
            m.forward = m.forward_split
    return prepared


def _write(model: nn.Module, file: Path, task: str, input_shape: tuple[int, ...], names: list[str]) -> None:
    import onnx

    dummy = torch.zeros(1, *input_shape)
    with torch.no_grad():
        out = model(dummy)
    if not isinstance(out, torch.Tensor):
        raise ExportError(f"the model returns {type(out).__name__}, not one tensor")
    want = 4 + len(names) if task == "detect" else len(names)
    if out.shape[1] != want:
        raise ExportError(f"output shape {tuple(out.shape)} does not fit {len(names)} class names ({task})")
    dynamic = {"images": {0: "batch"}, "output0": {0: "batch"}} if task == "classify" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter is legacy, chosen on purpose
        torch.onnx.export(
            model,
            (dummy,),
            str(file),
            opset_version=OPSET,
            input_names=["images"],
            output_names=["output0"],
            dynamic_axes=dynamic,
            dynamo=False,  # the dynamo exporter needs onnxscript, which is not installed
        )
    proto = onnx.load(str(file))
    meta = {"format": ONNX_FORMAT, "task": task, "names": json.dumps(names), "input_shape": json.dumps(input_shape)}
    for key, value in meta.items():
        prop = proto.metadata_props.add()
        prop.key, prop.value = key, value
    onnx.save(proto, str(file))


def max_abs_diff(
    model: nn.Module, file: Path, input_shape: tuple[int, ...], batch: int, task: str = "classify"
) -> float:
    """Largest |onnxruntime - PyTorch| over ``CHECK_SAMPLES`` seeded uniform [0, 1) inputs (image-like).

    Detector boxes are compared as fractions of the input size (like the class scores, in [0, 1]): in pixels,
    float32 rounding alone exceeds 1e-4 once boxes reach ~100 px (1.2e-4 seen on a trained YOLO11n at 160)."""
    from models.onnx_runtime import cpu_session

    session = cpu_session(file, quiet=True)
    generator = torch.Generator().manual_seed(SEED)
    worst = 0.0
    for _ in range(CHECK_SAMPLES):
        x = torch.rand(batch, *input_shape, generator=generator)
        with torch.no_grad():
            expected = model(x).numpy()
        (got,) = session.run(["output0"], {"images": x.numpy()})
        if got.shape != expected.shape:
            raise ExportError(f"onnxruntime output shape {got.shape} != PyTorch {expected.shape}")
        if task == "detect":
            scale = np.ones((1, expected.shape[1], 1), np.float32)
            scale[:, :4] = 1.0 / max(input_shape[1:])
            got, expected = got * scale, expected * scale
        diff = float(np.max(np.abs(got - expected)))
        if math.isnan(diff):
            return diff
        worst = max(worst, diff)
    return worst


def export_global(model_name: str, arrays: dict[str, np.ndarray], path: Path, *, names: Sequence[str],
                  image_size: int) -> ExportReport:  # fmt: skip
    """``arrays`` of zoo model ``model_name`` as a checked ONNX file at ``path``; detectors at ``image_size``
    pixels square, classifiers at their zoo input shape with classes named by ``names``."""
    from models.tasks import task_of
    from models.weights import load_arrays
    from models.zoo import build_model, input_shape

    try:
        task = task_of(model_name)
        model = build_model(model_name, num_classes=len(names))
        load_arrays(model, arrays)
    except ValueError as exc:  # an unknown model or arrays of another: nothing to export, no reason to crash
        return ExportReport(False, None, math.inf, 0.0, str(exc))
    shape = (3, image_size, image_size) if task == "detect" else input_shape(model_name)
    return export_onnx(model, path, task=task, input_shape=shape, names=names)
