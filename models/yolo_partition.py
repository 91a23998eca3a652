"""Split the train images of a YOLO dataset across N agents (``skyfed data partition``), as seed 001's hosts had.

Schemes: ``uniform`` (random, image counts equal to within one), ``class-skew[:DOMINANCE]`` (each agent is given
a class, classes taken in turn from the one dominating most images down, and a DOMINANCE share of its images,
default 0.8, is images whose most frequent class is that one, as far as there are enough; the rest is random) and
``by-source`` (an image's source is its file stem before the first ``_``, the VisDrone sequence, e.g.
``0000002_00005_d_0000014.jpg`` → ``0000002``; whole sources go to agents, largest first to the agent with the
fewest images, so no sequence is seen by two agents). Every agent's val split is the source's whole val split.

Output: ``DST/agent-01/data.yaml`` … with ``train.txt``/``val.txt`` lists of absolute image paths (labels stay
where they are), or with ``--copy`` real ``images/`` and ``labels/`` copies to ship to a device. The same seed
gives the same split. This module never modifies the source dataset and never writes into a non-empty DST.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.yolo_dataset import (
    DatasetError,
    DetectionData,
    label_file,
    load_data_yaml,
    read_labels,
    write_data_yaml,
)

SCHEMES = ("uniform", "class-skew", "by-source")
DEFAULT_DOMINANCE = 0.8


@dataclass(frozen=True)
class AgentShard:
    """One agent's share: its data.yaml, its train images and their objects per class."""

    name: str
    yaml_path: Path
    images: tuple[Path, ...]
    counts: np.ndarray
    skew_class: str | None = None


@dataclass(frozen=True)
class Partition:
    names: tuple[str, ...]
    shards: tuple[AgentShard, ...]
    val_images: int


def parse_scheme(text: str) -> tuple[str, float]:
    """``(scheme, dominance)`` from ``uniform``, ``class-skew[:DOMINANCE]`` or ``by-source``."""
    kind, sep, value = text.partition(":")
    if kind not in SCHEMES or (sep and kind != "class-skew"):
        raise DatasetError(f"--scheme {text!r}: use uniform, class-skew[:DOMINANCE] (e.g. class-skew:0.8) or by-source")
    if not sep:
        return kind, DEFAULT_DOMINANCE
    try:
        dominance = float(value)
    except ValueError:
        dominance = float("nan")
    if not 0 < dominance <= 1:
        raise DatasetError(f"--scheme {text!r}: DOMINANCE must be a number in (0, 1], e.g. class-skew:0.8")
    return kind, dominance


def uniform_split(images: int, agents: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(part) for part in np.array_split(rng.permutation(images), agents)]


def dominant_classes(counts: np.ndarray) -> np.ndarray:
    """Per image the class with most objects (ties → lowest id); -1 for an image without objects."""
    return np.where(counts.sum(axis=1) > 0, counts.argmax(axis=1), -1)


def agent_classes(dominant: np.ndarray, agents: int) -> np.ndarray:
    """The class each agent is skewed toward: classes by how many images they dominate, most first, in turn."""
    images_per_class = np.bincount(dominant[dominant >= 0])
    ranked = [c for c in np.argsort(-images_per_class, kind="stable") if images_per_class[c] > 0]
    if not ranked:
        raise DatasetError("--scheme class-skew: no train image has a label; use --scheme uniform or by-source")
    return np.array([ranked[i % len(ranked)] for i in range(agents)])


def class_skew_split(
    dominant: np.ndarray, agents: int, dominance: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
    """``(parts, classes)``: equal-sized parts, each first given up to ``dominance`` of its size from images its
    class dominates (fewer when they run out), then filled at random from what is left."""
    sizes = [len(part) for part in np.array_split(np.arange(len(dominant)), agents)]
    classes = agent_classes(dominant, agents)
    order = rng.permutation(len(dominant))
    taken = np.zeros(len(dominant), bool)
    parts = []
    for size, cls in zip(sizes, classes, strict=True):
        own = order[(dominant[order] == cls) & ~taken[order]][: int(round(dominance * size))]
        taken[own] = True
        parts.append(own)
    rest = order[~taken[order]]
    bounds = np.cumsum([0] + [size - len(part) for size, part in zip(sizes, parts, strict=True)])
    parts = [
        np.sort(np.concatenate([part, rest[a:b]])) for part, a, b in zip(parts, bounds[:-1], bounds[1:], strict=True)
    ]
    return parts, classes


def source_of(image: Path) -> str:
    """The source sequence of an image: its stem up to the first ``_`` (the whole stem when there is none)."""
    return image.stem.split("_", 1)[0]


def source_split(sources: Sequence[str], agents: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Whole groups of equal ``sources`` per agent: largest group first (ties in seeded order) to the agent with
    the fewest images so far, which keeps image counts close without splitting a sequence."""
    keys, group = np.unique(np.asarray(sources), return_inverse=True)
    if len(keys) < agents:
        raise DatasetError(
            f"--agents {agents} but the train images come from only {len(keys)} sources (file-name part before "
            f"the first '_'): use --agents {len(keys)} or fewer, or --scheme uniform"
        )
    sizes = np.bincount(group)
    order = rng.permutation(len(keys))
    order = order[np.argsort(-sizes[order], kind="stable")]
    load = np.zeros(agents, np.int64)
    owner = np.empty(len(keys), np.int64)
    for g in order:
        owner[g] = int(np.argmin(load))
        load[owner[g]] += sizes[g]
    return [np.flatnonzero(owner[group] == agent) for agent in range(agents)]


def partition_dataset(
    data_yaml: Path, agents: int, scheme: str, out: Path, seed: int = 0, copy: bool = False
) -> Partition:
    """Split ``data_yaml``'s train images across ``agents`` and write one dataset per agent under ``out``."""
    kind, dominance = parse_scheme(scheme)
    if agents < 1:
        raise DatasetError(f"--agents {agents}: give at least 1 agent")
    data = load_data_yaml(data_yaml)
    if agents > len(data.train):
        raise DatasetError(
            f"--agents {agents} is more than the {len(data.train)} train images of {data_yaml}: use at most "
            f"{len(data.train)}"
        )
    if out.exists() and any(out.iterdir()):
        raise DatasetError(f"--out {out} is not empty: give a new folder (nothing is overwritten)")
    counts = np.array([_image_counts(image, data.num_classes) for image in data.train]).reshape(-1, data.num_classes)
    rng = np.random.default_rng(seed)
    classes = None
    if kind == "uniform":
        parts = uniform_split(len(data.train), agents, rng)
    elif kind == "class-skew":
        parts, classes = class_skew_split(dominant_classes(counts), agents, dominance, rng)
    else:
        parts = source_split([source_of(image) for image in data.train], agents, rng)
    shards = []
    for i, part in enumerate(parts):
        name = f"agent-{i + 1:02d}"
        images = tuple(data.train[j] for j in part)
        folder = out / name
        folder.mkdir(parents=True)
        yaml_path = _write_copies(folder, images, data.val, data.names) if copy else _write_lists(folder, images, data)
        skew = None if classes is None else data.names[classes[i]]
        shards.append(AgentShard(name, yaml_path, images, counts[part].sum(axis=0), skew))
    return Partition(data.names, tuple(shards), len(data.val))


def _image_counts(image: Path, num_classes: int) -> np.ndarray:
    labels = read_labels(label_file(image), num_classes)
    return np.bincount(labels[:, 0].astype(np.int64), minlength=num_classes)


def _write_lists(folder: Path, images: tuple[Path, ...], data: DetectionData) -> Path:
    """Absolute-path image lists: nothing is copied and Ultralytics finds each label next to its image."""
    for split, paths in (("train", images), ("val", data.val)):
        (folder / f"{split}.txt").write_text("".join(f"{path.absolute()}\n" for path in paths))
    return write_data_yaml(folder, data.names, train="train.txt", val="val.txt")


def _write_copies(folder: Path, train: tuple[Path, ...], val: tuple[Path, ...], names: tuple[str, ...]) -> Path:
    """Self-contained copies (``images/{split}``, ``labels/{split}``) for a device that cannot see the source."""
    for split, paths in (("train", train), ("val", val)):
        seen: set[str] = set()
        for split_dir in ("images", "labels"):
            (folder / split_dir / split).mkdir(parents=True)
        for image in paths:
            if image.name in seen:
                raise DatasetError(
                    f"two {split} images are named {image.name}: --copy needs unique file names; drop --copy"
                )
            seen.add(image.name)
            shutil.copy2(image, folder / "images" / split / image.name)
            if label_file(image).is_file():
                shutil.copy2(label_file(image), folder / "labels" / split / f"{image.stem}.txt")
    return write_data_yaml(folder, names)


def format_partition(partition: Partition) -> list[str]:
    """One line per agent (images, objects, objects per class) and a total line."""
    lines = [
        _line(shard.name, len(shard.images), shard.counts, partition.names)
        + ("" if shard.skew_class is None else f", skewed toward {shard.skew_class}")
        for shard in partition.shards
    ]
    total = np.sum([shard.counts for shard in partition.shards], axis=0)
    images = sum(len(shard.images) for shard in partition.shards)
    lines.append(
        _line("total", images, total, partition.names)
        + f" over {len(partition.shards)} agents; each agent's val: the {partition.val_images} val images"
    )
    return lines


def _line(name: str, images: int, counts: np.ndarray, names: tuple[str, ...]) -> str:
    per_class = ", ".join(f"{cls} {int(n)}" for cls, n in zip(names, counts, strict=True))
    return f"{name}: {images} images, {int(counts.sum())} objects ({per_class})"
