"""How far one round may move the model in force, from the federation's own recent history.

The influence bounds (``flcore.bounds``) are relative to the round: a clip of twice the lower median
norm follows honest training. But once the model in force is bad, honest updates grow with its loss, the
clip grows with them, and a rogue participant's reversed step grows too: measured with one agent of three
sending its delta x -20 with a huge claim, the round's median norm went 7.5 -> 8 -> 58 -> 2e7 and the loss
2.4 -> 12 -> 4,253 -> 1.5e11 in four committed rounds (docs/results/robustness.md). So a published step is
also held to ``change_multiple`` x the median norm of the last ``WINDOW`` committed steps (the first
step: the round's clip bound, which a convex combination of clipped deltas meets anyway) and *shrunk* to
that length when it is longer: the direction the round chose stays, only the length is bounded, so an
honest federation loses nothing but an unusually long step, and an exploding one cannot compound faster
than ``change_multiple`` per ``WINDOW // 2`` rounds.

A step within that bound can still be bad; ``collapse`` is the last look before a commit: a round whose
evaluation loss passes ``collapse_ratio`` x the model in force's (at least ``LOSS_FLOOR`` nats: a loss of
0.01 doubling is no collapse) is rolled back; an evaluation without a loss (a detector's mAP) collapses
when its score falls below 1 / ``collapse_ratio`` of the model in force's.

Pure bookkeeping over norms; the caller (the server's pipeline, a peer's round) moves the vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from flcore import blas
from protocol.messages import headline

WINDOW = 8  # committed steps whose median sets the bound
LOSS_FLOOR = 0.5  # nats: a smaller loss in force counts as this much when judging a collapse
SCORE_FLOOR = 0.2  # a score in force below this is too low to collapse from


@dataclass
class ChangeHistory:
    """The norms of the last committed steps (checkpointed with the server's or peer's state)."""

    norms: list[float] = field(default_factory=list)

    def limit(self, multiple: float, clip_bound: float) -> float:
        """How long this round's step may be (inf: no bound). ``multiple`` 0 turns the bound off."""
        if multiple <= 0:
            return math.inf
        if not self.norms:
            return clip_bound  # inf when the clip is off: nothing to measure a first step against
        return multiple * float(np.median(self.norms))

    def note(self, norm: float) -> None:
        """A step of length ``norm`` was committed."""
        if math.isfinite(norm):
            self.norms = [*self.norms, norm][-WINDOW:]

    def to_list(self) -> list[float]:
        return list(self.norms)

    @classmethod
    def from_list(cls, norms: list | None) -> ChangeHistory:
        return cls([float(n) for n in (norms or []) if isinstance(n, (int, float)) and math.isfinite(n)][-WINDOW:])


def shrink_step(new: np.ndarray, current: np.ndarray, limit: float) -> tuple[np.ndarray, float, float]:
    """``(model, norm, factor)``: ``new`` moved back towards ``current`` so the step is at most ``limit``
    long (``factor`` < 1 when it was shortened), with the step's length after it."""
    step = new - current
    norm = math.sqrt(float(blas.sdot(step, step))) if step.size else 0.0
    if not math.isfinite(norm) or norm <= limit:
        return new, norm, 1.0
    factor = limit / norm
    return current + step * np.float32(factor), limit, factor


def collapse(in_force: dict[str, float], candidate: dict[str, float], ratio: float) -> str:
    """Why ``candidate``'s evaluation is a collapse from the model in force's ("" when it is not, or when
    either is missing: the first evaluated round has nothing to fall from)."""
    if ratio <= 0 or not in_force or not candidate:
        return ""
    if not all(math.isfinite(v) for v in candidate.values() if v is not None):
        return "evaluation-collapsed: non-finite"
    if in_force.get("loss") is not None and candidate.get("loss") is not None:
        floor = max(float(in_force["loss"]), LOSS_FLOOR)
        if candidate["loss"] > ratio * floor:
            return f"evaluation-collapsed: loss {candidate['loss']:.4g} > {ratio:g} x {floor:.4g}"
        return ""
    before, after = headline(in_force), headline(candidate)
    if before is not None and after is not None and before >= SCORE_FLOOR and after < before / ratio:
        return f"evaluation-collapsed: score {after:.4g} < {before:.4g} / {ratio:g}"
    return ""
