"""Partitioners that split a labelled dataset across agents, deterministic under a seed.

- ``iid``: a random permutation cut into near-equal parts.
- ``shards``: McMahan et al. 2017 (arXiv:1602.05629) pathological non-IID: sort by label, cut into
  ``n_clients * shards_per_client`` equal shards, give each client ``shards_per_client`` of them.
- ``dirichlet``: per class, proportions drawn from Dirichlet(α) (Hsu et al. 2019, arXiv:1909.06335);
  small α gives each client few classes, large α approaches IID.
``shards`` is ``shards:2``. ``holdout`` then cuts a client's local test split off its share.
A ``--partition`` spec may add feature skew, each agent's own input transformation (``models.feature_skew``):
``LABELS+feature-skew[:OPTIONS]``, or ``feature-skew[:OPTIONS]`` alone for IID labels (``parse_plan``).
Pure numpy: labels in, index arrays out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from models.feature_skew import NAME as FEATURE_SKEW
from models.feature_skew import OPTIONS as FEATURE_SKEW_OPTIONS
from models.feature_skew import FeatureSkew

Partitioner = Callable[[np.ndarray, int, int], list[np.ndarray]]
LABEL_FORMS = "iid | shards | shards:K | dirichlet:ALPHA (e.g. dirichlet:0.5)"
FORMS = (
    f"{LABEL_FORMS}, each optionally +{FEATURE_SKEW}[:OPTIONS], or {FEATURE_SKEW}[:OPTIONS] alone (IID labels); "
    f"OPTIONS: {FEATURE_SKEW_OPTIONS} (e.g. shards:2+{FEATURE_SKEW}:rotate=45)"
)


def iid(labels: np.ndarray, n_clients: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(part) for part in np.array_split(order, n_clients)]


def shards(labels: np.ndarray, n_clients: int, seed: int, shards_per_client: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    by_label = np.argsort(labels, kind="stable")
    pieces = np.array_split(by_label, n_clients * shards_per_client)
    owners = rng.permutation(len(pieces)).reshape(n_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[i] for i in row])) for row in owners]


def dirichlet(
    labels: np.ndarray, n_clients: int, seed: int, alpha: float = 0.5, min_size: int = 10, max_tries: int = 100
) -> list[np.ndarray]:
    if alpha <= 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(n_clients, alpha))) * len(members)).astype(int)[:-1]
            for client, piece in enumerate(np.split(members, cuts)):
                parts[client].append(piece)
        result = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in result) >= min_size:
            return result
    raise ValueError(
        f"dirichlet(alpha={alpha}) could not give each of {n_clients} clients >= {min_size} samples "
        f"in {max_tries} draws; use fewer clients or a larger alpha"
    )


@dataclass(frozen=True)
class Plan:
    """A whole ``--partition`` spec: how the labels are split, and the feature skew on top (``None``: none)."""

    labels: Partitioner
    features: FeatureSkew | None = None


def parse_plan(spec: str) -> Plan:
    """``LABELS``, ``LABELS+feature-skew[:OPTIONS]`` or ``feature-skew[:OPTIONS]`` (= ``iid+feature-skew…``)."""
    labels, plus, features = spec.partition("+")
    if not plus and labels.partition(":")[0] == FEATURE_SKEW:
        labels, features = "iid", spec
    if not plus and not features:
        return Plan(parse(labels))
    name, _, options = features.partition(":")
    if name != FEATURE_SKEW:
        raise ValueError(f"partition {spec!r}: after '+' comes {FEATURE_SKEW}[:OPTIONS], got {features!r}; use {FORMS}")
    label_split = parse(labels)
    try:
        return Plan(label_split, FeatureSkew.parse(options))
    except ValueError as exc:
        raise ValueError(f"partition {spec!r}: {exc}") from None


def parse(spec: str) -> Partitioner:
    """``"iid"``, ``"shards"``, ``"shards:K"`` or ``"dirichlet:ALPHA"`` → a partitioner (labels only)."""
    name, _, arg = spec.partition(":")
    try:
        if name == "iid" and not arg:
            return iid
        if name == "shards":
            return partial(shards, shards_per_client=int(arg)) if arg else shards
        if name == "dirichlet" and arg:
            return partial(dirichlet, alpha=float(arg))
    except ValueError:
        pass
    raise ValueError(f"partition {spec!r} is not understood; use {FORMS}")


def holdout(labels: np.ndarray, fraction: float, seed: int | tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) positions into ``labels``: round(fraction·N) held out, stratified by label. Each label
    gives floor(fraction·n) of its n samples, and the remainders go one each to the labels with the largest
    fractional parts, so the total is exact and no label is more than one sample off its share."""
    if not 0 <= fraction < 1:
        raise ValueError(f"holdout fraction must be in [0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    quotas = fraction * counts
    take = np.floor(quotas).astype(int)
    short = round(fraction * len(labels)) - int(take.sum())
    order = np.lexsort((rng.permutation(len(classes)), -(quotas - take)))  # largest remainder, ties drawn
    take[order[:short]] += 1
    held = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take, strict=True)]
    held_out = np.sort(np.concatenate([np.zeros(0, np.int64), *held]))
    return np.setdiff1d(np.arange(len(labels)), held_out), held_out


def label_histogram(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """(n_clients, num_classes) label counts, for reporting how skewed a split is."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


SHARE_MODES = ("unify", "share-disjoint")


@dataclass(frozen=True)
class SharedSplit:
    """The agents' shares after carving a shared pool out of them (seed 002's hybrid data sharing)."""

    parts: list[np.ndarray]  # the shares of the agents that still run, in their original order
    pool: np.ndarray  # positions given to the shared pool (empty: no pool)
    gave_all: tuple[int, ...] = ()  # unify: the agents (by position in the input) that gave all and do not run


def share(parts: list[np.ndarray], ratio: float, mode: str, seed: int) -> SharedSplit:
    """Seed 002's ``_centralize_trainsets``: ``unify`` moves the whole share of ⌊ratio·N⌋ agents drawn at random
    into the pool (those agents no longer run); ``share-disjoint`` moves ⌊ratio·nᵢ⌋ random samples of every
    agent's share. Where the seed is silent: ratio 0 (or a count that rounds down to 0) gives no pool and
    leaves the shares as they are; a ratio that would leave no agent (unify) or an agent with no samples
    (share-disjoint, e.g. ratio 1) is refused rather than run a federation without agents."""
    if mode not in SHARE_MODES:
        raise ValueError(f"share mode must be one of {', '.join(SHARE_MODES)}, got {mode!r}")
    if not 0 <= ratio <= 1:
        raise ValueError(f"share ratio must be in [0, 1], got {ratio}")
    rng = np.random.default_rng(seed)
    empty = np.zeros(0, np.int64)
    if mode == "unify":
        count = int(ratio * len(parts))
        if count >= len(parts):
            raise ValueError(f"unify with share ratio {ratio} moves all {len(parts)} agents' data into the pool, "
                             "leaving no agent to run: use a ratio below 1 (or more agents)")  # fmt: skip
        gave = sorted(int(i) for i in rng.choice(len(parts), count, replace=False))
        pool = np.sort(np.concatenate([empty, *(parts[i] for i in gave)]))
        return SharedSplit([p for i, p in enumerate(parts) if i not in gave], pool, tuple(gave))
    kept, shared = [], [empty]
    for index, part in enumerate(parts):
        count = int(ratio * len(part))
        if count >= len(part) and len(part):
            raise ValueError(f"share-disjoint with share ratio {ratio} moves all {len(part)} samples of agent "
                             f"{index + 1} into the pool, leaving it nothing to train on: use a smaller "
                             "ratio")  # fmt: skip
        moved = rng.permutation(part)[:count]
        shared.append(moved)
        kept.append(np.setdiff1d(part, moved))
    return SharedSplit(kept, np.sort(np.concatenate(shared)))
