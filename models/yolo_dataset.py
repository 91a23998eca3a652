"""YOLO-format detection datasets on disk: ``data.yaml``, image folders and label files.

The format Ultralytics reads (docs.ultralytics.com/datasets/detect): a ``data.yaml`` with ``path`` (the
root; relative to the yaml when relative), ``train`` and ``val`` (an image folder, or a ``.txt`` listing
images, relative to the root) and ``names`` (a list, or a mapping id → name); every image
``…/images/…/x.jpg`` has a label file ``…/labels/…/x.txt`` with one ``class cx cy w h`` line per object,
all but the class normalised to [0, 1] by the image size. An image without a label file has no objects.

This module only reads, counts and writes that format; training and validation are Ultralytics'.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})


class DatasetError(ValueError):
    """A YOLO dataset that cannot be used; ``str()`` names the file, the key and the fix."""


@dataclass(frozen=True)
class DetectionData:
    """One YOLO dataset: where its ``data.yaml`` is, its images per split and its class names."""

    yaml_path: Path
    root: Path
    train: tuple[Path, ...]
    val: tuple[Path, ...]
    names: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.names)


def label_file(image: Path) -> Path:
    """The label file of ``image``: the last ``images`` folder in its path becomes ``labels``, suffix ``.txt``
    (Ultralytics' ``img2label_paths``)."""
    parts = list(image.parts)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "images":
            parts[i] = "labels"
            break
    return Path(*parts).with_suffix(".txt")


def read_labels(path: Path, num_classes: int | None = None) -> np.ndarray:
    """The ``(n, 5)`` float array of ``class cx cy w h`` rows in ``path`` (empty when the file is missing)."""
    if not path.exists():
        return np.zeros((0, 5), np.float32)
    try:
        text = path.read_text()
        if not text.strip():
            return np.zeros((0, 5), np.float32)
        rows = np.loadtxt(text.splitlines(), dtype=np.float32, ndmin=2)
    except ValueError as exc:
        raise DatasetError(f"label file {path} is not 'class cx cy w h' numbers per line ({exc})") from None
    if rows.size == 0:
        return np.zeros((0, 5), np.float32)
    if rows.shape[1] != 5:
        raise DatasetError(f"label file {path} has {rows.shape[1]} columns per line; expected 5: class cx cy w h")
    classes = rows[:, 0]
    if not np.all(np.isfinite(rows)) or np.any(classes != np.round(classes)) or np.any(classes < 0):
        raise DatasetError(f"label file {path}: class ids must be integers >= 0 and every value finite")
    if num_classes is not None and np.any(classes >= num_classes):
        raise DatasetError(f"label file {path} has class {int(classes.max())} but the dataset names {num_classes}")
    if np.any(rows[:, 1:] < 0) or np.any(rows[:, 1:] > 1):
        raise DatasetError(f"label file {path}: box values must be normalised to [0, 1]")
    return rows


def class_counts(images: Iterable[Path], num_classes: int) -> np.ndarray:
    """Objects per class over ``images`` (int64, length ``num_classes``)."""
    counts = np.zeros(num_classes, np.int64)
    for image in images:
        labels = read_labels(label_file(image), num_classes)
        counts += np.bincount(labels[:, 0].astype(np.int64), minlength=num_classes)
    return counts


def list_images(source: Path) -> tuple[Path, ...]:
    """The images of a split: every image file under a folder (sorted), or the lines of a ``.txt`` list."""
    if source.is_dir():
        return tuple(sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES))
    if source.suffix == ".txt" and source.is_file():
        lines = [line.strip() for line in source.read_text().splitlines() if line.strip()]
        return tuple((source.parent / line).resolve() if not Path(line).is_absolute() else Path(line) for line in lines)
    raise DatasetError(f"{source} is neither an image folder nor a .txt list of images")


def load_data_yaml(path: Path) -> DetectionData:
    """Read and check a ``data.yaml``; every error names the file, the key and what is expected."""
    try:
        import yaml  # here: an agent's config check of a classifier does not read YAML

        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc}") from None
    if not isinstance(document, dict):
        raise DatasetError(f"{path} must be a YAML mapping with keys path, train, val and names")
    names = _names(path, document.get("names"))
    root = Path(document.get("path") or ".")
    root = root if root.is_absolute() else (path.parent / root).resolve()
    splits = {}
    for key in ("train", "val"):
        value = document.get(key)
        if not isinstance(value, str) or not value:
            raise DatasetError(f"{path}: '{key}' must name an image folder or a .txt list (relative to 'path')")
        splits[key] = list_images(root / value)
    if not splits["train"]:
        raise DatasetError(f"{path}: the train split ({document['train']!r}) holds no images")
    return DetectionData(path.resolve(), root, splits["train"], splits["val"], names)


def _names(path: Path, names: object) -> tuple[str, ...]:
    if isinstance(names, dict) and sorted(names) == list(range(len(names))):
        names = [names[i] for i in range(len(names))]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise DatasetError(f"{path}: 'names' must be a non-empty list of class names (or a mapping 0..n-1 → name)")
    if len(set(names)) != len(names):
        raise DatasetError(f"{path}: 'names' repeats a class name")
    return tuple(names)


def write_data_yaml(root: Path, names: Sequence[str], train: str = "images/train", val: str = "images/val") -> Path:
    """Write ``root/data.yaml`` without ``path`` (the root is then the yaml's folder, for Ultralytics too, so
    the folder can be moved) and return its path."""
    import yaml  # on use, as in load_data_yaml

    path = root / "data.yaml"
    document = {"train": train, "val": val, "names": list(names)}
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def resolved_yaml(data: DetectionData, out: Path) -> Path:
    """Write ``out`` (a data.yaml for Ultralytics) naming ``data``'s root and splits by absolute path."""
    import yaml  # on use, as in load_data_yaml

    lists = {}
    for split, images in (("train", data.train), ("val", data.val)):
        listing = out.with_name(f"{out.stem}-{split}.txt")
        listing.write_text("".join(f"{image.resolve()}\n" for image in images))
        lists[split] = str(listing.resolve())
    out.write_text(yaml.safe_dump({"path": str(data.root.resolve()), **lists, "names": list(data.names)},
                                  sort_keys=False))  # fmt: skip
    return out
