"""The two ends of aggregating a round's accepted updates, shared by the server's close-of-round pipeline
(``broker_server.rounds.pipeline``) and a peer (``agent.peer``), so both bound and check exactly alike:

* ``bounded_contributions``: the round's exact influence bounds (``flcore.bounds``) from every accepted
  update's norm and claimed weight, and each update as a strategy sees it (``Contribution``);
* ``check_new_model``: the strategy's new model must be finite, keep the model's invariants and move no
  further than the limit (the clip bound for strategies whose output is a convex combination of
  clipped deltas, ``bounds.max_change_norm`` when set).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from flcore import blas
from flcore.bounds import Influence, InfluencePolicy, bound_influence
from flcore.rounds import UpdateRecord
from flcore.strategies.base import Contribution
from flcore.update import UpdateRejected
from flcore.validation import check_invariants, positive_ranges
from models.weights import TensorSpec


def bounded_contributions(
    policy: InfluencePolicy, updates: list[UpdateRecord], open_delta: Callable[[str], np.ndarray]
) -> tuple[Influence, list[Contribution]]:
    """The round's bounds and its contributions, in the order of ``updates``, each named by its record's ``key``;
    a late update's capped weight is multiplied by its staleness ``discount`` (``flcore.late``)."""
    norms = np.array([u.norm for u in updates])
    influence = bound_influence(policy=policy, norms=norms, samples=np.array([u.samples for u in updates]))
    contributions = [
        Contribution(u.key, open_delta(u.key), float(capped) * u.discount, float(scale), u.norm, u.folded)
        for u, capped, scale in zip(updates, influence.samples, influence.scales, strict=True)
    ]
    return influence, contributions


def change_limit(policy: InfluencePolicy, influence: Influence, bounded_by_clip: bool) -> float:
    """How far a round's new model may move from the current one (inf: no limit)."""
    limits = [math.inf]
    if policy.max_change_norm > 0:
        limits.append(policy.max_change_norm)
    if bounded_by_clip and math.isfinite(influence.clip_bound):
        limits.append(influence.clip_bound * (1 + 1e-3))
    return min(limits)


def check_new_model(
    new: np.ndarray, current: np.ndarray, spec: tuple[TensorSpec, ...], *, limit: float = math.inf,
    invariants: bool = True,
) -> float:
    """The L2 norm of ``new - current``; ``UpdateRejected`` (``non-finite-model``, ``invalid-running-var``,
    ``change-too-large``) when ``new`` must not replace ``current``. ``invariants=False`` checks only that
    it is finite (differential privacy: a verdict on the un-noised average would reveal something)."""
    change = new - current
    norm = math.sqrt(float(blas.sdot(change, change))) if change.size else 0.0
    if not math.isfinite(norm) or not np.isfinite(new).all():
        raise UpdateRejected("non-finite-model")
    if not invariants:
        return norm
    check_invariants(change, current, positive_ranges(spec))  # a strategy that extrapolates may break them
    if norm > limit:
        raise UpdateRejected(f"change-too-large: {norm:.4g} > {limit:.4g}")
    return norm
