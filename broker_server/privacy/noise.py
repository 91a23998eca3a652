"""Differential privacy's noise step (``broker_server.privacy.policy`` for the mechanism and its settings).

The noise is float32 from numpy's PCG64 seeded with 128 bits from the OS (``broker_server.privacy.gaussian``), drawn
afresh every round and never stored. Mironov's floating-point attack on textbook Gaussian samplers
("On Significance of the Least Significant Bits for Differential Privacy", CCS 2012) is not
defended (docs/privacy.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from broker_server.privacy.gaussian import NORM_SLACK, clamp_nonnegative, fresh_rng, gaussian_noise
from broker_server.privacy.policy import PrivacyPolicy
from broker_server.rounds.pipeline import RoundContext, Step
from flcore.dp_sensitivity import mean_sensitivity
from flcore.validation import positive_ranges
from models.weights import with_floats


@dataclass
class AddNoise(Step):
    """After the check of the clipped aggregate: add N(0, (z·Δ)²) to every floating value of the new model,
    Δ = ``sensitivity``(n, S') for n aggregated updates and S' = S·(1 + ``NORM_SLACK``) for the round's clip
    S: the strategy's ``dp_sensitivity``, S'/n for (DP-)FedAvg. With an adaptive clip, z is the update's
    share z_Δ (``broker_server.privacy.adaptive_clip``). A round that publishes nothing (model swapping's ``swap``)
    added its noise to each model it released (``release``): its result, the mean of those, gets none here."""

    policy: PrivacyPolicy
    sensitivity: Callable[[int, float], float | None] = mean_sensitivity
    name: str = "add-noise"

    def run(self, ctx: RoundContext) -> None:
        assert ctx.result is not None and ctx.influence is not None and ctx.contributions
        if not ctx.plan.publish:
            return
        n = len(ctx.contributions)
        sensitivity = self.sensitivity(n, ctx.influence.clip_bound * (1 + NORM_SLACK))
        if sensitivity is None:  # the configuration check refuses such a strategy: never reached
            raise ValueError("this strategy has no sensitivity bound for differential privacy")
        std = self.policy.update_noise_multiplier(n) * sensitivity
        vector = ctx.result.global_vector + gaussian_noise(ctx.result.global_vector.size, std, fresh_rng())
        clamp_nonnegative(vector, positive_ranges(ctx.float_spec))
        ctx.result = replace(ctx.result, global_vector=vector)
        ctx.candidate = with_floats(ctx.global_arrays, vector, ctx.float_spec)
        ctx.noise_std = std
