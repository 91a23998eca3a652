"""VisDrone-DET → YOLO format, the conversion seed 001 (SmartFed, section 4) describes, for ``skyfed data``.

A VisDrone annotation line is ``bbox_left,bbox_top,bbox_width,bbox_height,score,object_category,truncation,
occlusion`` in pixels (a trailing comma occurs and is tolerated). The YOLO line is ``class cx cy w h`` with
``cx = (2*left + width) / (2W)``, ``cy = (2*top + height) / (2H)``, ``w = width / W``, ``h = height / H``, W and H
read from the image header. Dropped, each counted by reason: score 0 (ignored regions), category 0 (ignored),
category 11 (``others``), boxes with no area left once clipped to the image, and ``motor`` under ``--motor drop``.

``motor`` (category 10): the thesis never names it and its 9 result classes leave it out, so how it was handled is
not stated. ``--motor keep`` (default) gives 10 classes, the names and order of Ultralytics' ``VisDrone.yaml``;
``--motor drop`` gives the thesis' 9 classes. Ids are re-indexed to 0..n-1 in VisDrone's category order.

A malformed line (not 8 integer fields, a category outside 0..11) or an image without its annotation file is an
error naming file and line, never a skipped row: the official files have none, so one means a wrong or damaged
download, and skipping it would silently change the object counts compared with the thesis.

SRC is one split folder (``images/`` + ``annotations/``) or a root of ``VisDrone2019-DET-{train,val,test-dev}``
folders; DST gets ``images/{split}``, ``labels/{split}`` and ``data.yaml``. This module never modifies SRC.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from models.yolo_dataset import IMAGE_SUFFIXES, DatasetError, write_data_yaml

CATEGORIES = ("pedestrian", "people", "bicycle", "car", "van", "truck", "tricycle", "awning-tricycle", "bus", "motor")
MOTOR = 10
OTHERS = 11
# Why a row was dropped; index 0 means kept. ``convert_rows`` returns one of these indices per row.
REASONS = (
    "kept",
    "ignored region (score 0)",
    "ignored (category 0)",
    "others (category 11)",
    "motor (--motor drop)",
    "no area left after clipping to the image",
)
FIELDS = 8
SPLIT_PATTERN = re.compile(r"(?:^|[-_])(train|val|test-dev)$")


@dataclass
class ConversionSummary:
    """What a conversion wrote and left out, for the printed summary and the tests."""

    names: tuple[str, ...]
    yaml_path: Path
    images: dict[str, int] = field(default_factory=dict)
    objects: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dropped: dict[str, int] = field(default_factory=dict)
    clipped: int = 0
    linked: int = 0
    notes: list[str] = field(default_factory=list)


def class_names(motor: str) -> tuple[str, ...]:
    """The YOLO class names for ``--motor keep`` (10, Ultralytics' VisDrone.yaml) or ``drop`` (the thesis' 9)."""
    if motor not in ("keep", "drop"):
        raise DatasetError(f"--motor {motor!r}: use keep (10 classes) or drop (the thesis' 9 classes)")
    return CATEGORIES if motor == "keep" else CATEGORIES[: MOTOR - 1]


def parse_annotation(text: str, source: str) -> np.ndarray:
    """The ``(n, 8)`` int64 rows of one annotation file; ``source`` names the file in errors. Blank lines skip."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = [f.strip() for f in line.strip().split(",")]
        if fields == [""]:
            continue
        if len(fields) == FIELDS + 1 and fields[-1] == "":
            fields.pop()
        if len(fields) != FIELDS:
            raise DatasetError(
                f"{source} line {number}: {len(fields)} fields in {line.strip()!r}; VisDrone-DET has 8: "
                "bbox_left,bbox_top,bbox_width,bbox_height,score,object_category,truncation,occlusion"
            )
        try:
            row = [int(f) for f in fields]
        except ValueError:
            raise DatasetError(f"{source} line {number}: {line.strip()!r} has a non-integer field") from None
        if not 0 <= row[5] <= OTHERS:
            raise DatasetError(f"{source} line {number}: object_category {row[5]} is outside VisDrone's 0..11")
        rows.append(row)
    return np.array(rows, np.int64).reshape(-1, FIELDS)


def convert_rows(rows: np.ndarray, width: int, height: int, motor: str = "keep") -> tuple[np.ndarray, np.ndarray]:
    """``(labels, reasons)``: the ``(k, 5)`` float64 YOLO rows of the kept ``rows`` (boxes clipped to the
    ``width`` × ``height`` image) and, per input row, its index into ``REASONS`` (0 = kept)."""
    keep_motor = class_names(motor) == CATEGORIES
    score, category = rows[:, 4], rows[:, 5]
    x1 = np.clip(rows[:, 0], 0, width)
    y1 = np.clip(rows[:, 1], 0, height)
    x2 = np.clip(rows[:, 0] + rows[:, 2], 0, width)
    y2 = np.clip(rows[:, 1] + rows[:, 3], 0, height)
    reasons = np.select(
        [
            score == 0,
            category == 0,
            category == OTHERS,
            (category == MOTOR) & (not keep_motor),
            (x2 <= x1) | (y2 <= y1),
        ],
        [1, 2, 3, 4, 5],
        0,
    )
    kept = reasons == 0
    x1, y1, x2, y2 = (a[kept].astype(np.float64) for a in (x1, y1, x2, y2))
    labels = np.stack(
        [category[kept] - 1, (x1 + x2) / (2 * width), (y1 + y2) / (2 * height), (x2 - x1) / width, (y2 - y1) / height],
        axis=1,
    )
    return labels, reasons


def clipped_rows(rows: np.ndarray, width: int, height: int) -> np.ndarray:
    """Which rows reach past the image (they are kept, clipped, when anything is left)."""
    return (rows[:, 0] < 0) | (rows[:, 1] < 0) | (rows[:, 0] + rows[:, 2] > width) | (rows[:, 1] + rows[:, 3] > height)


def format_labels(labels: np.ndarray) -> str:
    return "".join(f"{int(c)} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}\n" for c, cx, cy, w, h in labels)


def find_splits(src: Path) -> dict[str, Path]:
    """``{split: folder}``: SRC itself when it holds ``images/`` and ``annotations/`` (its split from its name,
    else train), or every ``…-train``, ``…-val``, ``…-test-dev`` folder under it (test-dev → test)."""
    if not src.is_dir():
        raise DatasetError(f"SRC {src} is not a folder: give a VisDrone-DET split folder or the folder holding them")
    if (src / "images").is_dir() and (src / "annotations").is_dir():
        return {_split_name(src.name) or "train": src}
    splits: dict[str, Path] = {}
    for child in sorted(p for p in src.iterdir() if p.is_dir()):
        split = _split_name(child.name)
        if split is None:
            continue
        if split in splits:
            raise DatasetError(f"SRC {src} holds two {split} splits ({splits[split].name}, {child.name}): keep one")
        if not ((child / "images").is_dir() and (child / "annotations").is_dir()):
            raise DatasetError(f"{child} lacks images/ or annotations/: re-extract VisDrone2019-DET-{split}.zip")
        splits[split] = child
    if not splits:
        raise DatasetError(
            f"SRC {src} holds neither images/ + annotations/ nor VisDrone2019-DET-train/-val/-test-dev folders"
        )
    return {split: splits[split] for split in ("train", "val", "test") if split in splits}


def _split_name(name: str) -> str | None:
    match = SPLIT_PATTERN.search(name)
    return None if match is None else {"test-dev": "test"}.get(match.group(1), match.group(1))


def convert(src: Path, dst: Path, motor: str = "keep") -> ConversionSummary:
    """Convert every split under ``src`` into the YOLO dataset ``dst`` (a new or empty folder)."""
    names = class_names(motor)
    splits = find_splits(src)
    if dst.exists() and any(dst.iterdir()):
        raise DatasetError(f"DST {dst} is not empty: give a new folder (nothing is overwritten)")
    summary = ConversionSummary(names, dst / "data.yaml", objects=np.zeros(len(names), np.int64))
    dropped = np.zeros(len(REASONS), np.int64)
    for split, folder in splits.items():
        images = sorted(p for p in (folder / "images").iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        (dst / "images" / split).mkdir(parents=True, exist_ok=True)
        (dst / "labels" / split).mkdir(parents=True, exist_ok=True)
        for image in images:
            annotation = folder / "annotations" / f"{image.stem}.txt"
            if not annotation.is_file():
                raise DatasetError(f"image {image} has no annotation file {annotation}: re-extract the split")
            rows = parse_annotation(annotation.read_text(), str(annotation))
            width, height = _image_size(image)
            labels, reasons = convert_rows(rows, width, height, motor)
            summary.clipped += int(np.count_nonzero(clipped_rows(rows, width, height) & (reasons == 0)))
            dropped += np.bincount(reasons, minlength=len(REASONS))
            summary.objects += np.bincount(labels[:, 0].astype(np.int64), minlength=len(names))
            (dst / "labels" / split / f"{image.stem}.txt").write_text(format_labels(labels))
            summary.linked += _link_or_copy(image, dst / "images" / split / image.name)
        summary.images[split] = len(images)
    summary.dropped = {reason: int(n) for reason, n in zip(REASONS[1:], dropped[1:], strict=True)}
    _write_yaml(dst, names, list(splits), summary.notes)
    return summary


def _image_size(image: Path) -> tuple[int, int]:
    """Width and height from the header (PIL opens lazily, the pixels are never decoded)."""
    try:
        with Image.open(image) as img:
            return img.size
    except OSError as exc:
        raise DatasetError(f"cannot read the size of image {image}: {exc}") from None


def _link_or_copy(source: Path, target: Path) -> int:
    """1 when hard-linked (same filesystem: no second copy of ~2 GB), 0 when copied."""
    try:
        os.link(source, target)
        return 1
    except OSError:
        shutil.copy2(source, target)
        return 0


def _write_yaml(dst: Path, names: tuple[str, ...], splits: list[str], notes: list[str]) -> None:
    """data.yaml via ``write_data_yaml``; Ultralytics needs a val split, so a missing one falls back (noted)."""
    train = "train" if "train" in splits else splits[0]
    val = next(s for s in ("val", "test", train) if s in splits)
    for key, split in (("train", train), ("val", val)):
        if split != key:
            notes.append(f"no {key} split in SRC: data.yaml's {key} is images/{split} (add VisDrone2019-DET-{key})")
    path = write_data_yaml(dst, names, train=f"images/{train}", val=f"images/{val}")
    if "test" in splits:
        with path.open("a") as stream:
            stream.write(yaml.safe_dump({"test": "images/test"}))


def format_summary(summary: ConversionSummary) -> list[str]:
    """The lines ``skyfed data visdrone-to-yolo`` prints."""
    images = ", ".join(f"{split} {n}" for split, n in summary.images.items())
    objects = ", ".join(f"{name} {n}" for name, n in zip(summary.names, summary.objects, strict=True))
    dropped = ", ".join(f"{reason} {n}" for reason, n in summary.dropped.items())
    return [
        f"wrote {summary.yaml_path} ({len(summary.names)} classes)",
        f"images: {images} ({summary.linked} hard-linked, {sum(summary.images.values()) - summary.linked} copied)",
        f"objects: {int(summary.objects.sum())} ({objects}); {summary.clipped} boxes clipped to the image",
        f"dropped rows: {sum(summary.dropped.values())} ({dropped})",
        *(f"note: {note}" for note in summary.notes),
    ]
