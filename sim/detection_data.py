"""Synthetic detection data for a local federation (``skyfed sim --task detect``).

Every agent gets its own YOLO dataset (``<root>/<agent>/data/``: train and val splits, ``data.yaml``),
drawn with its own class mix, and the server a balanced validation set (``<root>/server/eval/``).
Partitions: ``iid`` (every agent sees every class equally) or ``class-skew:D`` (a share ``D`` of an
agent's objects come from one class of its own; ``models.synthetic_detection.class_skew``). A density skew
``S`` spreads the agents' mean objects per image evenly over ``DENSITY·(1-S) … DENSITY·(1+S)`` (a drone
over a car park next to one over fields), so their object-count weights differ too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.synthetic_detection import CLASSES, DENSITY, class_skew, write_dataset
from models.yolo_dataset import DetectionData, load_data_yaml, resolved_yaml

PARTITIONS = "iid | class-skew:D (D in [1/4, 1]: the share of an agent's objects from its own class)"


def class_probs(partition: str, agent: int, agents: int) -> np.ndarray:
    """The class mix of agent number ``agent`` (0-based) under ``partition``."""
    if partition == "iid":
        return np.full(len(CLASSES), 1 / len(CLASSES))
    kind, _, value = partition.partition(":")
    if kind == "class-skew":
        try:
            return class_skew(agent, agents, float(value or 0.7))
        except ValueError as exc:
            raise ValueError(f"--partition {partition!r}: {exc}") from None
    raise ValueError(f"--partition {partition!r} is not a detection partition; use {PARTITIONS}")


def densities(agents: int, skew: float) -> np.ndarray:
    """Each agent's mean objects per image under density skew ``skew`` in [0, 1): evenly spread around DENSITY."""
    if not 0 <= skew < 1:
        raise ValueError(f"--density-skew must be in [0, 1) (0: every agent {DENSITY:g} objects per image), got {skew}")
    return DENSITY * (1 + skew * np.linspace(-1, 1, agents)) if agents > 1 else np.array([DENSITY])


def write_detection_data(root: Path, names: list[str], partition: str, seed: int, *, images: int,
                         image_size: int, density_skew: float = 0.0) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Per-agent datasets of ``images`` training images (a quarter as many for local validation) and the
    server's 64-image validation set; returns each agent's class probabilities (rows) and density."""
    mixes = np.array([class_probs(partition, i, len(names)) for i in range(len(names))])
    density = densities(len(names), density_skew)
    write_dataset(root / "server" / "eval", train=1, val=64, seed=seed * 7919 + 1, size=image_size)
    for i, (name, probs) in enumerate(zip(names, mixes, strict=True)):
        write_dataset(root / name / "data", train=images, val=max(4, images // 4), seed=seed * 7919 + 2 + i,
                      size=image_size, class_probs=probs, density=float(density[i]))  # fmt: skip
    return mixes, density


def pool(sources: list[Path], out: Path) -> Path:
    """One dataset made of every ``sources`` dataset's images (listed, not copied): ``out/data.yaml``."""
    datasets = [load_data_yaml(s) for s in sources]
    out.mkdir(parents=True, exist_ok=True)
    union = DetectionData(out / "data.yaml", out, tuple(i for d in datasets for i in d.train),
                          tuple(i for d in datasets for i in d.val), datasets[0].names)  # fmt: skip
    return resolved_yaml(union, union.yaml_path)


def describe_mixes(mixes: np.ndarray, density: np.ndarray, names: list[str]) -> list[str]:
    """One line per agent: its class mix and density, e.g. ``agent-01: car 70%, truck 10%, …; 6.0 objects/image``."""
    return [f"{name}: " + ", ".join(f"{c.name} {p:.0%}" for c, p in zip(CLASSES, row, strict=True))
            + f"; {d:.1f} objects/image" for name, row, d in zip(names, mixes, density, strict=True)]  # fmt: skip
