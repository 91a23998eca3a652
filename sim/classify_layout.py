"""A classification dataset laid out for a federation: the server's evaluation set, each agent's training
share and local test split, and (seed 002's hybrid sharing) the server's pool.

With feature skew (``--partition …+feature-skew``, ``models.feature_skew``) an agent's share is its domain:
its training file and its local test split both go through its transformation, so C-SPE is measured on the
agent's own domain, as seed 003 scores its V-MNIST clients. The server's evaluation set is not left plain:
it is dealt into one equal part per agent, same label mix in each, and each part goes through that agent's
transformation. It is then the federation's own mixture of domains in equal measure, which is what the
global objective averages over and what DemLearn's C-GEN means ("the collective test data of all clients",
seed 000); an untransformed set would be a domain no agent holds, and would score out-of-domain
generalization instead. Under ``unify`` the agents whose shares went to the server's pool keep their
domains there and in the evaluation set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models import feature_skew, partition
from models.classify_data import classify_data
from models.dataset import Dataset
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


def with_feature_skew(
    pool: Dataset, evaluation: Dataset, shares: list[np.ndarray], spec: feature_skew.FeatureSkew, seed: int
) -> tuple[Dataset, Dataset, list[feature_skew.Transform]]:
    """``pool`` with every share under its agent's transformation, ``evaluation`` dealt into one equal part per
    share under the same ones (the module's docstring says why), and each share's transformation."""
    unit = float(pool.x.std())  # offset and noise are in the pool's standard deviations
    owner = np.empty(len(pool), np.int64)
    for agent, share in enumerate(shares):
        owner[share] = agent
    dealt = feature_skew.deal(evaluation.y, len(shares), seed)
    return (feature_skew.transformed(pool, owner, spec, seed, unit, stream=0),
            feature_skew.transformed(evaluation, dealt, spec, seed, unit, stream=1),
            [feature_skew.draw(spec, seed, agent, unit) for agent in range(len(shares))])  # fmt: skip


def write_classify_data(
    root: Path, names: list[str], partition_spec: str, seed: int, dataset: str = "digits", *,
    sharing: Sharing | None = None,
) -> tuple[np.ndarray, np.ndarray, list[str]]:  # fmt: skip
    """``dataset`` (``models.classify_data``) laid out for a federation: its evaluation set as
    ``root/server/test.npz`` (the server's ``eval_data``) and its pool partitioned across ``names``; each
    agent's share cut into ``root/<name>/data.npz`` (its ``agent.data``) and ``root/<name>/test.npz`` (its
    ``agent.test_data``: LOCAL_TEST_FRACTION of it, stratified by label, never trained on). With ``sharing``,
    the partition makes ``sharing.shares`` shares and the server's pool (``root/server/shared.npz``) is carved
    out of them before the agents hold out their test splits; ``names`` are the agents left. With feature skew,
    every file holds its samples under their agent's transformation (``with_feature_skew``). Returns the label
    histograms per agent of the training files and of the local test splits, and each agent's transformation
    in words ("" without feature skew)."""
    pool, evaluation = classify_data(dataset).load(seed)
    sharing = sharing or Sharing(len(names))
    plan = partition.parse_plan(partition_spec)
    shares = plan.labels(pool.y, sharing.shares, seed)
    split = partition.share(shares, sharing.ratio, sharing.mode, seed)
    domains = [""] * len(names)
    if plan.features is not None:
        pool, evaluation, transforms = with_feature_skew(pool, evaluation, shares, plan.features, seed)
        kept = [t for agent, t in enumerate(transforms) if agent not in split.gave_all]
        domains = [t.describe() for t in kept]
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
    return partition.label_histogram(pool.y, trains, 10), partition.label_histogram(pool.y, tests, 10), domains


def describe_partition(train: np.ndarray, test: np.ndarray, names: list[str], domains: list[str]) -> list[str]:
    """One line per agent: its training sample count, the labels it holds, its local test split's size and,
    with feature skew, its transformation."""
    lines = []
    for name, counts, held, domain in zip(names, train, test, domains, strict=True):
        labels = ",".join(str(label) for label in np.flatnonzero(counts + held))
        line = f"{name}: {int(counts.sum())} samples, labels {labels}; {int(held.sum())} held out to test"
        lines.append(f"{line}; {domain}" if domain else line)
    return lines
