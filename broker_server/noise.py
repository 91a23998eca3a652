"""Differential privacy's noise step (``broker_server.privacy`` for the mechanism and its settings).

The noise is float32 from numpy's PCG64 seeded with 128 bits from the OS (``secrets``), drawn afresh
every round and never stored. Mironov's floating-point attack on textbook Gaussian samplers
("On Significance of the Least Significant Bits for Differential Privacy", CCS 2012) is not
defended (docs/privacy.md).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from broker_server.pipeline import RoundContext, Step
from broker_server.privacy import PrivacyPolicy
from flcore.dp_sensitivity import mean_sensitivity
from flcore.validation import positive_ranges
from models.weights import TensorRange, TensorSpec, with_floats


def gaussian_noise(size: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """N(0, std²) as float32, ``size`` values."""
    noise = rng.standard_normal(size, dtype=np.float32)
    noise *= np.float32(std)
    return noise


def fresh_rng() -> np.random.Generator:
    """A generator seeded with 128 bits from the OS, for one round's noise."""
    return np.random.default_rng(secrets.randbits(128))


def clamp_nonnegative(vector: np.ndarray, ranges: tuple[TensorRange, ...]) -> None:
    """Running variances pushed below zero by the noise are set to zero (post-processing)."""
    for r in ranges:
        np.maximum(vector[r.start : r.stop], 0, out=vector[r.start : r.stop])


# An update's L2 norm is summed in float32: for n values it may be off by up to n·2⁻²⁴ relative (0.2 %
# at 38,476 values), so a clipped update may exceed S by that much. The noise covers S·(1 + NORM_SLACK).
NORM_SLACK = 2e-3


def release(model: np.ndarray, std: float, spec: tuple[TensorSpec, ...]) -> np.ndarray:
    """One agent's kept model as it may leave the server under differential privacy (model swapping): the
    model plus N(0, std²) on every float, running variances kept non-negative (post-processing).

    Sensitivity: the kept model is aₖ + clip_S(Δₖ), where aₖ is the model the server last named to agent k
    (the global model or a model released to it by this function: itself the output of earlier, charged
    mechanisms) and Δₖ its uploaded change from aₖ, since local rounds upload nothing (``local_rounds``).
    Replacing agent k's data (its clipped change replaced by zero, ``REPLACE_SPECIAL``) moves the model by
    ‖clip_S(Δₖ)‖ ≤ S(1 + ``NORM_SLACK``) = S', so with std = z·S' the release is a Gaussian mechanism with
    noise multiplier z for agent k alone; every other agent's data enters only through aₖ (post-processing)."""
    vector = model + gaussian_noise(model.size, std, fresh_rng())
    clamp_nonnegative(vector, positive_ranges(spec))
    return vector


@dataclass
class AddNoise(Step):
    """After the check of the clipped aggregate: add N(0, (z·Δ)²) to every floating value of the new model,
    Δ = ``sensitivity``(n, S') for n aggregated updates and S' = S·(1 + ``NORM_SLACK``) for the round's clip
    S: the strategy's ``dp_sensitivity``, S'/n for (DP-)FedAvg. With an adaptive clip, z is the update's
    share z_Δ (``broker_server.adaptive_clip``). A round that publishes nothing (model swapping's ``swap``)
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
