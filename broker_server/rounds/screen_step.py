"""The pipeline step that screens a small round's updates on the server's evaluation set (``flcore.screening``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from broker_server.rounds.pipeline import RoundContext, Step
from flcore.screening import screen
from flcore.strategies.base import Strategy
from models.weights import NamedArrays


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
        dropped = screen(ctx.contributions, ctx.global_arrays, ctx.global_vector, ctx.float_spec, self.evaluator,
                         self.in_force(), self.below)  # fmt: skip
        if not dropped:
            return
        for i in dropped:
            self.strategy.unfold(ctx.contributions[i])
        ctx.step_detail["screened"] = {ctx.contributions[i].agent: why for i, why in sorted(dropped.items())}
        ctx.contributions = [c for i, c in enumerate(ctx.contributions) if i not in dropped]
