"""A synthetic aerial-style detection dataset in YOLO format, so demos, tests and benchmarks run offline.

Each image is textured ground (smooth colour fields, grain, a road now and then) seen from above, with
small objects of a few classes that differ in size, shape and colour, as vehicles and people do in
drone footage. Per-agent skew comes from ``class_probs`` (which classes an agent's objects are drawn
from) and ``density`` (objects per image). Everything is drawn from one seeded generator: the same
arguments give the same files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from models.yolo_dataset import write_data_yaml


@dataclass(frozen=True)
class ObjectClass:
    name: str
    size: tuple[int, int]  # (long side, short side) in pixels at 160 px image size
    colour: tuple[int, int, int]
    round: bool = False


CLASSES: tuple[ObjectClass, ...] = (
    ObjectClass("car", (12, 7), (200, 40, 40)),
    ObjectClass("truck", (20, 9), (230, 200, 40)),
    ObjectClass("person", (6, 6), (40, 60, 220), round=True),
    ObjectClass("bus", (26, 10), (240, 240, 240)),
)
NAMES: tuple[str, ...] = tuple(c.name for c in CLASSES)
DENSITY = 6.0  # mean objects per image (Poisson) unless a dataset asks for another


def ground(rng: np.random.Generator, size: int) -> np.ndarray:
    """An ``(size, size, 3)`` float image of textured ground: smooth colour fields plus grain."""
    coarse = rng.uniform(0, 1, (size // 16 + 2, size // 16 + 2, 1))
    field = np.kron(coarse, np.ones((16, 16, 1)))[:size, :size]
    field = (field + np.roll(field, 8, 0) + np.roll(field, 8, 1) + np.roll(field, (8, 8), (0, 1))) / 4
    grass, soil = np.array([70, 110, 60]), np.array([130, 115, 90])
    image = grass + field * (soil - grass) + rng.normal(0, 10, (size, size, 3))
    if rng.random() < 0.5:  # a road across the image
        position, width = rng.integers(0, size), rng.integers(size // 12, size // 6)
        axis_slice = np.s_[:, position : position + width] if rng.random() < 0.5 else np.s_[position : position + width]
        image[axis_slice] = 95 + rng.normal(0, 6, image[axis_slice].shape)
    return image


def draw(image: np.ndarray, rng: np.random.Generator, kind: ObjectClass, scale: float) -> np.ndarray | None:
    """Draw one object at a free random place; return its YOLO box (cx, cy, w, h), or None if it did not fit."""
    size = image.shape[0]
    long, short = (max(3, round(s * scale * rng.uniform(0.85, 1.15))) for s in kind.size)
    w, h = (long, short) if rng.random() < 0.5 else (short, long)
    if w >= size or h >= size:
        return None
    x, y = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
    colour = np.array(kind.colour) * rng.uniform(0.8, 1.1) + rng.normal(0, 6, (h, w, 3))
    if kind.round:
        yy, xx = np.mgrid[:h, :w]
        mask = ((yy - (h - 1) / 2) / (h / 2)) ** 2 + ((xx - (w - 1) / 2) / (w / 2)) ** 2 <= 1.0
        image[y : y + h, x : x + w][mask] = colour[mask]
    else:
        image[y : y + h, x : x + w] = colour
        image[y + h // 3, x : x + w] *= 0.7  # a roof line, so shapes are not flat boxes
    return np.array([(x + w / 2) / size, (y + h / 2) / size, w / size, h / size])


def render(
    rng: np.random.Generator, size: int, class_probs: np.ndarray, density: float
) -> tuple[Image.Image, np.ndarray]:
    """One image and its ``(n, 5)`` labels: Poisson(``density``) objects, classes drawn from ``class_probs``."""
    image = ground(rng, size)
    labels = []
    for class_id in rng.choice(len(CLASSES), size=rng.poisson(density), p=class_probs):
        box = draw(image, rng, CLASSES[class_id], scale=size / 160)
        if box is not None:
            labels.append([class_id, *box])
    pixels = Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))
    return pixels, np.array(labels, np.float64).reshape(-1, 5)


def write_split(root: Path, split: str, count: int, rng: np.random.Generator, *, size: int,
                class_probs: np.ndarray, density: float, prefix: str = "") -> None:  # fmt: skip
    """``count`` images into ``root/images/<split>`` and their labels into ``root/labels/<split>``."""
    images, labels = root / "images" / split, root / "labels" / split
    images.mkdir(parents=True, exist_ok=True)
    labels.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels, rows = render(rng, size, class_probs, density)
        stem = f"{prefix}{split}-{i:05d}"
        pixels.save(images / f"{stem}.jpg", quality=92)
        (labels / f"{stem}.txt").write_text("".join(f"{int(r[0])} {r[1]:.6f} {r[2]:.6f} {r[3]:.6f} {r[4]:.6f}\n"
                                                    for r in rows))  # fmt: skip


def write_dataset(root: Path, *, train: int, val: int, seed: int, size: int = 160, density: float = DENSITY,
                  class_probs: Sequence[float] | None = None) -> Path:  # fmt: skip
    """A whole YOLO dataset under ``root`` (train and val splits, ``data.yaml``); returns the yaml's path."""
    probs = np.full(len(CLASSES), 1 / len(CLASSES)) if class_probs is None else np.asarray(class_probs, float)
    if probs.shape != (len(CLASSES),) or np.any(probs < 0) or not np.isclose(probs.sum(), 1):
        raise ValueError(f"class_probs must be {len(CLASSES)} non-negative numbers summing to 1, got {class_probs}")
    rng = np.random.default_rng(seed)
    write_split(root, "train", train, rng, size=size, class_probs=probs, density=density)
    write_split(root, "val", val, rng, size=size, class_probs=probs, density=density)
    return write_data_yaml(root, NAMES)


def class_skew(agent: int, agents: int, dominance: float) -> np.ndarray:
    """Class probabilities for agent ``agent`` of ``agents``: ``dominance`` of its objects from one class of its
    own (agents take the classes in turn), the rest spread evenly over the others; 1/n each at 1/n."""
    k = len(CLASSES)
    if not 1 / k <= dominance <= 1:
        raise ValueError(f"dominance must be in [1/{k}, 1], got {dominance}")
    probs = np.full(k, (1 - dominance) / (k - 1))
    probs[agent % k] = dominance
    return probs
