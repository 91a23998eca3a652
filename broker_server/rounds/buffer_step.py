"""The pipeline step that makes an asynchronous round's aggregate FedBuff's step (``rounds.async_rounds``).

FedBuff (Nguyen et al., AISTATS 2022, Algorithm 1) moves the model by the server learning rate times the buffer's
mean of staleness-weighted updates, ``(1/K) sum f(s_i) delta_i``: a buffer of stale updates moves it less. The
strategy's aggregate is a weighted mean whose weights already carry ``f(s_i)`` (``UpdateRecord.discount``), so its
step is scaled by ``server_lr`` times the weighted mean of the discounts; with equal weights that is FedBuff's step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from broker_server.rounds.pipeline import RoundContext, Step
from models.weights import with_floats


def buffer_scale(server_lr: float, weights: np.ndarray, discounts: np.ndarray) -> float:
    """``server_lr`` times the ``weights``-weighted mean of the ``discounts`` (1 for an empty buffer)."""
    total = float(np.sum(weights))
    mean = float(np.dot(weights, discounts)) / total if total > 0 else 1.0
    return server_lr * mean


@dataclass
class ScaleBuffer(Step):
    server_lr: float
    name: str = "buffer-step"

    def run(self, ctx: RoundContext) -> None:
        assert ctx.result is not None and ctx.influence is not None
        discounts = np.array([u.discount for u in ctx.state.updates])
        factor = buffer_scale(self.server_lr, np.asarray(ctx.influence.samples, np.float64), discounts)
        ctx.step_detail["buffer_scale"] = round(factor, 6)
        if factor == 1.0:
            return
        new = ctx.global_vector + np.float32(factor) * (ctx.result.global_vector - ctx.global_vector)
        ctx.result = replace(ctx.result, global_vector=new.astype(np.float32, copy=False))
        ctx.candidate = with_floats(ctx.global_arrays, ctx.result.global_vector, ctx.float_spec)
