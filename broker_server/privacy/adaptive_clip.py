"""Adaptive clipping for central differential privacy (``[privacy] adaptive_clip = true``).

Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning with Adaptive Clipping"
(NeurIPS 2021, arXiv:1905.03871), Algorithm 1 with the geometric update: each round the server counts
the updates whose norm is at most the clip S, releases that count with Gaussian noise, and moves S
towards the γ-quantile of the norms:

    b̃ = (Σᵢ (bᵢ − ½) + N(0, σ_b²)) / n + ½,   bᵢ = 1[‖Δᵢ‖ ≤ S]
    S ← S · exp(−η · (b̃ − γ))

Centred, one agent moves the count by at most ½ (its update replaced by the zero update counts ½), so
the count is a Gaussian mechanism of multiplier 2σ_b. Run together with the update's noise of
multiplier z_Δ, the round is one Gaussian mechanism of multiplier z when (the paper's Theorem 1)

    z_Δ = (z⁻² − (2σ_b)⁻²)^(−½),

so the accountant charges z per round as with a fixed clip, and the update gets a little more noise
(``PrivacyPolicy.update_noise_multiplier``, used by the noise step). σ_b defaults to max(n/20, z): the
paper's m/20 (m updates expected per round), with a floor that keeps z_Δ within 1.155·z in small rounds.
The paper's defaults γ = 0.5 and η = 0.2 are ours too.
The neighbouring relation is dp-accounting's ``REPLACE_SPECIAL`` ("zero-out"): one agent's contribution
replaced by the special record ⊥, which adds the zero update to the sum and 0 to the centred count (as
bᵢ = ½ would; no real update does). Against ⊥ the centred count moves by at most ½. Against the
literal zero update (which counts bᵢ = 1) it could move by 1, and the ε reported would be that of a
smaller multiplier: the guarantee is zero-out DP, as the paper's add/remove analysis is.

Agents that send oversized (or zero) updates on purpose can push S up (or down) by e^(ηγ) (or
e^(−η(1−γ))) per round, when they are the round's majority; ``clip_range`` (default 100) keeps S within
[S₀/100, 100·S₀] however many rounds they do it (post-processing: it costs nothing).
The clip is state: it is kept in the privacy ledger, in the checkpoint, and published in the metrics
(a function of the noisy count only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from broker_server.privacy.gaussian import fresh_rng
from broker_server.privacy.policy import PrivacyPolicy
from broker_server.rounds.pipeline import RoundContext, Step


def noisy_unclipped_fraction(norms: np.ndarray, clip: float, count_stddev: float, rng: np.random.Generator) -> float:
    """b̃: the share of ``norms`` at most ``clip``, released with N(0, σ_b²) on the centred count, then
    clamped to [0, 1] (post-processing), so one round moves S by at most a factor e^η whatever the noise."""
    centred = float(np.sum(norms <= clip)) - len(norms) / 2
    return min(1.0, max(0.0, (centred + rng.normal(0.0, count_stddev)) / len(norms) + 0.5))


def next_clip(clip: float, unclipped: float, quantile: float, learning_rate: float) -> float:
    """The geometric update: S shrinks when more than γ of the updates fit, grows when fewer do."""
    return clip * math.exp(-learning_rate * (unclipped - quantile))


@dataclass
class AdaptClip(Step):
    """After the noise: the next round's clip from this round's noisy unclipped count."""

    policy: PrivacyPolicy
    name: str = "adapt-clip"

    def run(self, ctx: RoundContext) -> None:
        assert ctx.influence is not None and ctx.contributions
        norms = np.array([c.norm for c in ctx.contributions])
        sigma = self.policy.count_stddev(len(norms))
        unclipped = noisy_unclipped_fraction(norms, ctx.influence.clip_bound, sigma, fresh_rng())
        p = self.policy
        adapted = next_clip(ctx.influence.clip_bound, unclipped, p.target_quantile, p.clip_learning_rate)
        ctx.next_clip = min(p.clip * p.clip_range, max(p.clip / p.clip_range, adapted))
        ctx.step_detail.update(unclipped_fraction=round(unclipped, 4), next_clip=round(ctx.next_clip, 6))
