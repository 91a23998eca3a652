"""The Gaussian mechanism's draws and its releases: pure functions over float vectors, shared by the noise step
(``broker_server.privacy.noise``), the release of kept models (``broker_server.rounds.pipeline.PlanStarts``) and
the adaptive clip (``broker_server.privacy.adaptive_clip``). The generator is PCG64 seeded with 128 bits from the
OS, afresh for each draw's round (docs/privacy.md).
"""

from __future__ import annotations

import secrets

import numpy as np

from flcore.validation import positive_ranges
from models.weights import TensorRange, TensorSpec


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
