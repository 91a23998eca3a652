"""The pipeline step that screens a small round's updates on the server's evaluation set (``flcore.screening``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from broker_server.pipeline import RoundContext, Step
from flcore.screening import MIN_UPDATES, screened
from flcore.strategies.base import Strategy
from models.weights import NamedArrays, with_floats


@dataclass
class ScreenUpdates(Step):
    """In a round of fewer than ``below`` updates, each clipped update is scored at its share of the round; one
    whose step raises the validation loss is left out of the aggregate (``metrics.aggregation.screened``:
    agent -> reason). It stays accepted (it was valid); only its influence is taken back."""

    evaluator: Callable[[NamedArrays], dict[str, float]]
    in_force: Callable[[], dict[str, float]]
    strategy: Strategy
    below: int
    name: str = "screen"

    def run(self, ctx: RoundContext) -> None:
        n = len(ctx.contributions)
        if not MIN_UPDATES <= n < self.below:
            return
        base = self.in_force() or self.evaluator(ctx.global_arrays)
        if base.get("loss") is None:  # nothing to compare a trial with: spare the evaluations
            return
        trials = []
        for c in ctx.contributions:
            vector = ctx.global_vector + c.delta * np.float32(c.scale / n)
            trials.append(self.evaluator(with_floats(ctx.global_arrays, vector, ctx.float_spec)))
        dropped = screened(base, trials)
        for i in dropped:
            self.strategy.unfold(ctx.contributions[i])
        ctx.step_detail["screened"] = {ctx.contributions[i].agent: why for i, why in sorted(dropped.items())}
        ctx.contributions = [c for i, c in enumerate(ctx.contributions) if i not in dropped]
