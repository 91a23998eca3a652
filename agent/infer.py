"""On-device inference with a SkyFed ONNX model (``models.onnx_export``): onnxruntime, numpy and Pillow only.

Edge devices run this without PyTorch or Ultralytics, so it must never import either (a test checks
``sys.modules``). Everything it needs (task, class names, input shape) is read from the file's metadata.
Bad input (missing model, a non-SkyFed ONNX, an unreadable image) raises one ``ValueError`` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from models.onnx_runtime import cpu_session
from models.tasks import ONNX_FORMAT, TASKS

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})


@dataclass(frozen=True)
class OnnxModel:
    path: Path
    session: Any  # onnxruntime.InferenceSession
    task: str
    names: list[str]
    input_shape: tuple[int, ...]  # per sample, (C, H, W)


def load_model(path: Path) -> OnnxModel:
    """Open ``path`` and check its SkyFed metadata, so a wrong file fails here and not on the first image."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: model file not found")
    try:
        session = cpu_session(path)
    except Exception as exc:  # onnxruntime raises its own exception types for corrupt or foreign files
        raise ValueError(f"{path}: not a readable ONNX model ({str(exc).splitlines()[0]})") from None
    meta = session.get_modelmeta().custom_metadata_map
    if meta.get("format") != ONNX_FORMAT:
        raise ValueError(f"{path}: not a SkyFed ONNX model (no {ONNX_FORMAT!r} format tag in its metadata)")
    try:
        task, names, shape = meta["task"], json.loads(meta["names"]), tuple(json.loads(meta["input_shape"]))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: broken SkyFed metadata ({exc})") from None
    if task not in TASKS or len(shape) != 3 or shape[0] not in (1, 3):
        raise ValueError(f"{path}: unsupported SkyFed model (task {task!r}, input shape {shape})")
    return OnnxModel(path, session, task, [str(n) for n in names], shape)


def image_files(path: Path) -> list[Path]:
    """``path`` itself, or every image directly in the folder ``path``, sorted."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise ValueError(f"{path}: no images in this folder ({', '.join(sorted(IMAGE_SUFFIXES))})")
        return found
    if not path.is_file():
        raise ValueError(f"{path}: image not found")
    return [path]


def preprocess(image: Path, input_shape: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, int]]:
    """The model input ``(C, H, W)`` float32 in [0, 1] (plain resize, gray or RGB) and the original (w, h)."""
    channels, height, width = input_shape
    try:
        with Image.open(image) as img:
            size = img.size
            pixels = img.convert("L" if channels == 1 else "RGB").resize((width, height), Image.BILINEAR)
    except Exception as exc:  # Pillow's own errors, and more once Ultralytics (same process) patched Image.open
        raise ValueError(f"{image}: cannot read image ({exc})") from None
    array = np.asarray(pixels, dtype=np.float32) / 255.0
    return (array[None] if channels == 1 else array.transpose(2, 0, 1)), size


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def xywh_to_xyxy(xywh: np.ndarray) -> np.ndarray:
    xy, half = xywh[:, :2], xywh[:, 2:4] / 2
    return np.concatenate([xy - half, xy + half], axis=1)


def box_iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one xyxy ``box`` with each row of ``boxes``."""
    wh = np.clip(np.minimum(box[2:], boxes[:, 2:]) - np.maximum(box[:2], boxes[:, :2]), 0, None)
    inter = wh[:, 0] * wh[:, 1]
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return inter / np.maximum(area + areas - inter, 1e-9)


def nms(boxes: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, iou: float) -> np.ndarray:
    """Class-aware greedy NMS: indices kept, best score first; a box is dropped when its IoU with a better box
    of the same class exceeds ``iou`` (boxes of different classes never suppress each other)."""
    keep: list[int] = []
    for cls in np.unique(class_ids):
        order = np.flatnonzero(class_ids == cls)
        order = order[np.argsort(-scores[order], kind="stable")]
        while order.size:
            best, order = order[0], order[1:]
            keep.append(int(best))
            order = order[box_iou(boxes[best], boxes[order]) <= iou]
    kept = np.array(keep, dtype=np.int64)
    return kept[np.argsort(-scores[kept], kind="stable")]


def decode(pred: np.ndarray, conf: float, iou: float, max_det: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ultralytics' raw ``(4 + nc, anchors)`` output (xywh in input pixels, per-class scores) to xyxy boxes,
    scores and class ids after the confidence threshold and NMS."""
    class_scores = pred[4:]
    class_ids, scores = class_scores.argmax(axis=0), class_scores.max(axis=0)
    mask = scores > conf
    boxes = xywh_to_xyxy(pred[:4, mask].T)
    keep = nms(boxes, scores[mask], class_ids[mask], iou)[:max_det]
    return boxes[keep], scores[mask][keep], class_ids[mask][keep]


def infer(
    model_path: Path, images: Sequence[Path], *, conf: float = 0.25, iou: float = 0.45, max_det: int = 300
) -> list[dict]:
    """One JSON-ready dict per image: detections in the original image's pixels, or a class with its top 5."""
    model = load_model(model_path)
    return [
        _detect(model, Path(i), conf, iou, max_det) if model.task == "detect" else _classify(model, Path(i))
        for i in images
    ]


def _run(model: OnnxModel, x: np.ndarray) -> np.ndarray:
    return model.session.run(None, {model.session.get_inputs()[0].name: x[None]})[0][0]


def _classify(model: OnnxModel, image: Path) -> dict:
    x, _ = preprocess(image, model.input_shape)
    probs = softmax(_run(model, x))
    top = np.argsort(-probs, kind="stable")[:5]
    ranked = [{"class": model.names[i], "class_id": int(i), "confidence": round(float(probs[i]), 4)} for i in top]
    return {"image": str(image), **ranked[0], "top5": ranked}


def _detect(model: OnnxModel, image: Path, conf: float, iou: float, max_det: int) -> dict:
    x, (width, height) = preprocess(image, model.input_shape)
    raw = _run(model, x)
    boxes, scores, class_ids = decode(raw, conf, iou, max_det)
    scale = np.array([width, height, width, height]) / np.array([x.shape[2], x.shape[1], x.shape[2], x.shape[1]])
    boxes = np.clip(boxes * scale, 0, [width, height, width, height])
    detections = [
        {
            "class": model.names[c],
            "class_id": int(c),
            "confidence": round(float(s), 4),
            "box": [round(float(v), 2) for v in b],
        }
        for b, s, c in zip(boxes, scores, class_ids, strict=True)
    ]
    best = round(float(raw[4:].max()), 4) if raw.shape[1] else 0.0  # the most confident box, kept or not
    result = {"image": str(image), "detections": detections, "best_score": best}
    if not detections:  # say why it is empty: an undertrained model scores low, below the threshold
        result["hint"] = f"best score {best:.2f} < --conf {conf:g}"
    return result
