"""The default aggregation: Multi-Krum while the fleet's data looks alike, centered clipping otherwise.

Measured (docs/results/robustness.md, "Choosing the default aggregation"): no single strategy both loses
at most 1 point against FedAvg with nobody attacking on every split and holds within 2 points of its clean
run with 2 attackers in 10. Krum (f = 2) does the second on IID and Dirichlet 0.5 data, where centered
clipping loses 3.5 points to sign flips, but Krum drops honest agents with rare labels on skewed data and
loses 5.6 to 9.0 points there with nobody attacking; centered clipping is within 1 point everywhere.

So this strategy measures how alike the agents' data is from their updates: the **agreement** is the
median over agents of each agent's median cosine similarity to the other updates of a round (clipped
deltas). Taken in the first round that brings Krum's 2f + 3 updates, from a fresh model it was 0.91-0.93
on IID digits, 0.77-0.85 on Dirichlet 0.5, 0.46-0.66 on Dirichlet 0.1 and on 2 labels per agent, with or
without 2 attackers in 10 (a median over agents moves little while attackers are a minority: at most
0.08 here). Measured once and kept (checkpointed): at or above ``agreement`` (0.7), every later round
with at least 2f + 3 updates runs Krum; below it, or in a round with fewer updates (Krum's f would
fall), centered clipping. Centered clipping's reference follows every committed step, whichever
aggregation made it; in a round too small for Krum it centres on the round's median instead
(``centered_clip``, ``center``): there one participant is a large share of the round.

Where it can be wrong: the threshold was measured on the digits CNN from a fresh model; a model that
starts trained has updates that agree less, and the fleet gets centered clipping, the choice that is
never far off with nobody attacking. Attackers present in the measuring round who raise the agreement
(updates close to the honest mean) can at most buy Krum on skewed data: 5.6-9.0 points clean, less than
sign flips cost centered clipping there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flcore.strategies.base import Contribution, NamedArrays, RoundResult, Strategy
from flcore.strategies.centered_clip import CenteredClip
from flcore.strategies.krum import KrumOptions, MultiKrum, gram_matrix
from models.weights import TensorSpec


@dataclass(frozen=True)
class AutoOptions:
    f: int = 2  # Krum's count of attackers to tolerate: 2 of 10 (docs/results/robustness.md)
    agreement: float = 0.7  # at or above: the data looks alike, Krum; below: centered clipping

    def __post_init__(self) -> None:
        if self.f < 1:
            raise ValueError(f"strategy.f must be >= 1 (attackers Krum tolerates on data alike), got {self.f}")
        if not -1 <= self.agreement <= 1:
            raise ValueError(f"strategy.agreement must be a cosine similarity in [-1, 1], got {self.agreement}")


def agreement(gram: np.ndarray) -> float:
    """The median over updates of each one's median cosine similarity to the others (``gram``: their inner
    products). An all-zero update agrees with nothing (cosine 0)."""
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    outer = np.outer(norms, norms)
    cosine = np.divide(gram, outer, out=np.zeros_like(gram), where=outer > 0)
    n = len(gram)
    others = cosine[~np.eye(n, dtype=bool)].reshape(n, n - 1)
    return float(np.median(np.median(others, axis=1)))


class AutoDefault(Strategy):
    name = "auto"
    Options = AutoOptions
    bounded_by_clip = False  # centered clipping's step is not a convex combination of clipped deltas
    why_not_private = (
        "the default picks Krum or centered clipping from how much the un-noised updates agree, and the choice is "
        "published (remove strategy.name and auto's f and agreement: under privacy the default is fedavg)"
    )

    def __init__(self, options: AutoOptions | None = None) -> None:
        super().__init__(options)
        self.clip = CenteredClip()
        self.krum = MultiKrum(KrumOptions(f=self.options.f))
        self.measured = math.nan  # the agreement, once measured
        self._pending = math.nan

    @property
    def krum_needs(self) -> int:
        return 2 * self.options.f + 3

    def begin(self, global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:
        self.clip.begin(global_vector, spec)

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        n, threshold = len(contributions), self.options.agreement
        measured, gram, detail = self.measured, None, {}
        if n >= self.krum_needs and math.isnan(measured):
            gram = gram_matrix(contributions)
            measured = self._pending = agreement(gram)
            detail["decided"] = True
        center = "median" if n < self.krum_needs else "last-step"  # few updates: one is a large share
        if math.isnan(measured):
            why = f"{n} updates, agreement is measured on {self.krum_needs} (Krum f={self.options.f}'s minimum)"
        elif measured < threshold:
            why = f"updates agreed {measured:.2f} < {threshold:g}: the agents' data differ"
        elif n < self.krum_needs:
            why = f"{n} updates: Krum f={self.options.f} needs {self.krum_needs}"
        else:
            why = f"updates agreed {measured:.2f} >= {threshold:g}: the agents' data look alike"
            gram = gram_matrix(contributions) if gram is None else gram
            result = self.krum.aggregate_with(global_vector, contributions, gram)
            self.clip.follow(global_vector)
            return self._report(result, "krum", why, measured, detail)
        result = self.clip.aggregate_around(global_vector, contributions, center)
        return self._report(result, "centered-clip", why, measured, detail)

    @staticmethod
    def _report(result: RoundResult, chose: str, why: str, measured: float, extra: dict) -> RoundResult:
        agreed = None if math.isnan(measured) else round(measured, 4)
        detail = {**result.detail, "chose": chose, "why": why, "agreement": agreed, **extra}
        return RoundResult(result.global_vector, detail)

    def on_commit(self, result: RoundResult) -> None:
        self.clip.on_commit(result)
        if math.isnan(self.measured):
            self.measured = self._pending

    def state(self) -> NamedArrays:
        return {**self.clip.state(), "agreement": np.array([self.measured])}

    def restore(self, state: NamedArrays) -> None:
        self.clip.restore(state)
        self.measured = float(np.asarray(state.get("agreement", [math.nan])).reshape(-1)[0])
