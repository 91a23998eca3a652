"""A classification dataset laid out for a federation: the server's evaluation set, each agent's training
share and local test split, and (seed 002's hybrid sharing) the server's pool."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models import partition
from models.classify_data import classify_data
from models.datasets import save_npz

LOCAL_TEST_FRACTION = 0.2  # of each classify agent's share: its local test split, never trained on


@dataclass(frozen=True)
class Sharing:
    """Seed 002's hybrid data sharing in a sim: ``ratio`` of the partition's ``shares`` (agents before unify)
    carved out by ``mode`` into the server's pool (``models.partition.share``)."""

    shares: int
    ratio: float = 0.0
    mode: str = "share-disjoint"


def smallest_ratio(count: int) -> float:
    """The smallest share ratio, at 4 decimals, whose floor(ratio x ``count``) is 1: one agent (unify, ``count``
    agents) or one sample (share-disjoint, ``count`` samples in the largest share)."""
    return math.ceil(10_000 / count) / 10_000


POOL_FILE = "shared.npz"  # the server's [pool] data, beside its server.toml


def write_classify_data(
    root: Path, names: list[str], partition_spec: str, seed: int, dataset: str = "digits", *,
    sharing: Sharing | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``dataset`` (``models.classify_data``) laid out for a federation: its evaluation set as
    ``root/server/test.npz`` (the server's ``eval_data``) and its pool partitioned across ``names``; each
    agent's share cut into ``root/<name>/data.npz`` (its ``agent.data``) and ``root/<name>/test.npz`` (its
    ``agent.test_data``: LOCAL_TEST_FRACTION of it, stratified by label, never trained on). With ``sharing``,
    the partition makes ``sharing.shares`` shares and the server's pool (``root/server/shared.npz``) is carved
    out of them before the agents hold out their test splits; ``names`` are the agents left. Returns the label
    histograms per agent of the training files and of the local test splits."""
    pool, evaluation = classify_data(dataset).load(seed)
    sharing = sharing or Sharing(len(names))
    split = partition.share(partition.parse(partition_spec)(pool.y, sharing.shares, seed), sharing.ratio,
                            sharing.mode, seed)  # fmt: skip
    if sharing.ratio and not len(split.pool):  # share-disjoint: floor(ratio x n) = 0 for every agent's n samples
        raise ValueError(f"--share-ratio {sharing.ratio:g} with --share-mode {sharing.mode} gives the server's pool no "
                         f"sample (floor(ratio x samples) = 0 for every agent), so there would be no pool: use "
                         f"--share-ratio {smallest_ratio(max(len(p) for p in split.parts)):g} or more")  # fmt: skip
    (root / "server").mkdir(parents=True, exist_ok=True)
    save_npz(root / "server" / "test.npz", evaluation)
    if len(split.pool):
        save_npz(root / "server" / POOL_FILE, pool.subset(split.pool))
    trains, tests = [], []
    for index, (name, share) in enumerate(zip(names, split.parts, strict=True)):
        kept, held = partition.holdout(pool.y[share], LOCAL_TEST_FRACTION, seed=(seed, index))
        trains.append(share[kept])
        tests.append(share[held])
        (root / name).mkdir(parents=True, exist_ok=True)
        save_npz(root / name / "data.npz", pool.subset(share[kept]))
        save_npz(root / name / "test.npz", pool.subset(share[held]))
    return partition.label_histogram(pool.y, trains, 10), partition.label_histogram(pool.y, tests, 10)


def describe_partition(train: np.ndarray, test: np.ndarray, names: list[str]) -> list[str]:
    """One line per agent: its training sample count, the labels it holds and its local test split's size."""
    lines = []
    for name, counts, held in zip(names, train, test, strict=True):
        labels = ",".join(str(label) for label in np.flatnonzero(counts + held))
        lines.append(f"{name}: {int(counts.sum())} samples, labels {labels}; {int(held.sum())} held out to test")
    return lines
