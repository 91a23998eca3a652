"""Screening a small round's updates on a validation set: a step that makes the model worse is left out.

In a round of a handful of updates one rogue participant is a third of it, and no statistic of the
updates alone tells its reversed step from an honest one on other data: clipped to honest norms and
weighed as a third, a delta x -20 still held three agents at 0.76 accuracy against 0.98 clean
(docs/results/robustness.md, "A rogue of three"). Whoever aggregates holds a validation set (the server's
``eval_data``, a peer's own split), so each update is scored there at its share of the round: the model
in force plus sᵢ·Δᵢ/n, as Zeno scores a worker's gradient by the descent it brings on a validation batch
(Xie, Koyejo & Gupta, "Zeno: Distributed Stochastic Gradient Descent with Suspicion-based Fault-tolerance",
ICML 2019, arXiv:1805.10032). An update whose step raises the loss by more than ``TOLERANCE`` of it is left
out, the worst first, at most ⌊(n - 1)/2⌋ of them, so honest updates stay a majority of what is kept; of
two, one is left out when the other does not raise the loss (a round that closed on its quorum while an
agent was late is otherwise one honest update against one rogue's, at half the weight each).

``screened`` decides from evaluations; ``screen`` runs the trials for whoever aggregates (the server's
pipeline step, a peer's round) with its own evaluator.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from flcore.strategies.base import Contribution
from models.weights import NamedArrays, TensorSpec, with_floats

TOLERANCE = 0.01  # a step may raise the validation loss by this fraction of it before it is left out
MIN_UPDATES = 2


def screened(in_force: dict[str, float], trials: list[dict[str, float]]) -> dict[int, str]:
    """Which of the round's updates to leave out (index -> reason), from the model in force's evaluation and
    each update's trial (the model in force plus that update at its share): none without a loss to compare."""
    base = in_force.get("loss")
    if len(trials) < MIN_UPDATES or base is None or not math.isfinite(base):
        return {}
    losses = [t.get("loss", math.inf) for t in trials]
    if any(loss is None for loss in losses):
        return {}
    limit = base + TOLERANCE * max(base, 0.0)
    worse = sorted((i for i, loss in enumerate(losses) if not loss <= limit), key=lambda i: -losses[i])
    most = (len(trials) - 1) // 2 if len(trials) > 2 else len(trials) - len(worse)  # of two: one, if one is good
    return {i: f"raises-validation-loss: {base:.4g} -> {losses[i]:.4g}" for i in worse[:most]}


def screen(
    contributions: list[Contribution], model: NamedArrays, vector: np.ndarray, spec: tuple[TensorSpec, ...],
    evaluate: Callable[[NamedArrays], dict[str, float]], in_force: dict[str, float], below: int,
) -> dict[int, str]:
    """Trial every contribution of a round of ``MIN_UPDATES`` to ``below`` - 1 updates at its share (the model in
    force ``model``/``vector`` plus sᵢ·Δᵢ/n) with ``evaluate``, and decide (``screened``); ``in_force`` is the model
    in force's evaluation ({}: evaluated here)."""
    n = len(contributions)
    if not MIN_UPDATES <= n < below:
        return {}
    base = in_force or evaluate(model)
    if base.get("loss") is None:  # nothing to compare a trial with: spare the evaluations
        return {}
    trials = [evaluate(with_floats(model, vector + c.delta * np.float32(c.scale / n), spec)) for c in contributions]
    return screened(base, trials)
