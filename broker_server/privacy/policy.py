"""Central differential privacy at the aggregator: DP-FedAvg's Gaussian noise and its configuration.

DP-FedAvg (McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018, arXiv:1710.06963): every update is clipped to L2 norm S (``[privacy] clip``), the
clipped updates are averaged with equal weights, and Gaussian noise of standard deviation z·S / n is
added to the average of n updates (z = ``noise_multiplier``) before anything derived from it leaves
the server. Equivalently, the sum of the clipped updates gets N(0, z²S²): one agent, whatever its
data, moves that sum by at most S, so each round is a Gaussian mechanism with noise multiplier z for
every agent whose update it contains (user-level DP; the neighbouring datasets differ in one agent's
data, its update replaced by zero — dp-accounting's ``REPLACE_SPECIAL``). With ``weight_cap`` ŵ,
sample- (or object-) weighted FedAvg runs as the paper's Algorithm 1: weights min(nₖ/ŵ, 1) ≤ 1 over the
fixed denominator n, the same sensitivity. Robust strategies with a bounded sensitivity get noise
calibrated to it (``flcore.dp_sensitivity``); the others are refused, naming what works. What a strategy
is under privacy (weighted, unweighted, swapping, or why it has no bound) it declares itself
(``flcore.strategies.base.Strategy``), and its ``dp_sensitivity`` says whether it has a bound. The
accounting is in ``broker_server.privacy.accountant``; why SkyFed claims no amplification by sampling is there
too. The noise step is ``broker_server.privacy.noise``.

Everything after the noise is post-processing and costs no privacy: the evaluation, the commit or
roll-back decided on it, the best-model election. Everything before it must not leak: with privacy on,
``metrics.aggregation`` says only the clip bound and the noise (no per-agent norms or clip lists),
and the checks that look at the un-noised average (``bounds.max_change_norm``) are refused.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from broker_server.privacy.dp_epsilon import epsilon_of
from flcore.bounds import InfluencePolicy
from flcore.strategies import STRATEGIES, build_strategy
from flcore.strategies.choice import StrategyNote

if TYPE_CHECKING:
    from flcore.strategies.base import Strategy

# keys of [strategy] that do not name auto's options
DEFAULT_KEYS = {"weighting", "threshold", "elect_best", "late_weight"}


@dataclass(frozen=True)
class PrivacyPolicy:
    """``[privacy]`` of server.toml; absent or ``clip = 0``: no differential privacy."""

    clip: float = 0.0  # S, the L2 bound of every update
    noise_multiplier: float = 0.0  # z: noise standard deviation on the sum, in units of S
    delta: float = 1e-5
    target_epsilon: float = 0.0  # an agent is not selected again once one more round would pass it (0: no limit)
    # S follows a quantile of the update norms (broker_server.privacy.adaptive_clip); clip = S₀
    adaptive_clip: bool = False
    target_quantile: float = 0.5  # γ: the share of updates left unclipped
    clip_learning_rate: float = 0.2  # η: S ← S·exp(−η·(unclipped share − γ))
    clip_count_stddev: float = 0.0  # σ_b, the noise on the unclipped count (0: max(n/20, z) for n updates)
    clip_range: float = 100.0  # the adaptive S stays within [clip / clip_range, clip · clip_range]
    weight_cap: float = 0.0  # ŵ: with weighting = "samples", an update weighs min(samples / ŵ, 1) (0: none)

    def __post_init__(self) -> None:
        if not (self.clip >= 0 and math.isfinite(self.clip)):
            raise ValueError(
                f"privacy.clip must be a finite number >= 0 (0 = no differential privacy), got {self.clip}"
            )
        if self.enabled and not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(
                f"privacy.noise_multiplier must be > 0 when privacy.clip is set (e.g. 1.0), got {self.noise_multiplier}"
            )
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy.delta must be in (0, 1), e.g. 1e-5, got {self.delta}")
        if not (self.target_epsilon >= 0 and math.isfinite(self.target_epsilon)):
            raise ValueError(f"privacy.target_epsilon must be >= 0 (0 = no limit), got {self.target_epsilon}")
        if not (self.weight_cap >= 0 and math.isfinite(self.weight_cap)):
            raise ValueError(
                f"privacy.weight_cap must be a number >= 0 (the samples, or objects, at which an update counts "
                f"fully under differential privacy; 0 = none), got {self.weight_cap}"
            )
        if not self.enabled and (self.noise_multiplier or self.target_epsilon or self.weight_cap):
            raise ValueError(
                "privacy.clip must be > 0 to turn differential privacy on (noise_multiplier, target_epsilon or "
                "weight_cap is set without it, which would run without any privacy)"
            )
        if self.adaptive_clip:
            self._check_adaptive()
        if self.enabled and self.target_epsilon:
            one_round = epsilon_of(((self.noise_multiplier, 1),), self.delta)
            if one_round > self.target_epsilon:
                raise ValueError(
                    f"privacy.target_epsilon = {self.target_epsilon:g} is below what a single round costs (epsilon "
                    f"{one_round:.3g} at noise_multiplier {self.noise_multiplier:g}): raise the target or the noise"
                )

    def _check_adaptive(self) -> None:
        if not self.enabled:
            raise ValueError("privacy.adaptive_clip needs privacy.clip > 0 (the first round's clip, e.g. 0.1)")
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"privacy.target_quantile must be in (0, 1), e.g. 0.5, got {self.target_quantile}")
        if not 0 < self.clip_learning_rate <= 1:
            raise ValueError(f"privacy.clip_learning_rate must be in (0, 1], e.g. 0.2, got {self.clip_learning_rate}")
        if not (self.clip_range > 1 and math.isfinite(self.clip_range)):
            raise ValueError(f"privacy.clip_range must be a finite number > 1, e.g. 100, got {self.clip_range}")
        if self.clip_count_stddev and not self.clip_count_stddev > self.noise_multiplier / 2:
            raise ValueError(
                f"privacy.clip_count_stddev must be 0 (automatic) or above noise_multiplier / 2 = "
                f"{self.noise_multiplier / 2:g}, got {self.clip_count_stddev:g}: the count's noise alone would spend "
                "the round's whole budget (Andrew et al. suggest the expected updates per round / 20)"
            )

    @property
    def enabled(self) -> bool:
        return self.clip > 0

    def count_stddev(self, updates: int) -> float:
        """σ_b of the adaptive clip's count for a round of ``updates`` updates
        (``broker_server.privacy.adaptive_clip``)."""
        return self.clip_count_stddev or max(updates / 20, self.noise_multiplier)

    def update_noise_multiplier(self, updates: int) -> float:
        """The noise multiplier of the update's noise: z, or with an adaptive clip what the count leaves
        of it, z_Δ = (z⁻² − (2σ_b)⁻²)^(−½) (Andrew et al. 2021, Theorem 1)."""
        z = self.noise_multiplier
        return z if not self.adaptive_clip else (z**-2 - (2 * self.count_stddev(updates)) ** -2) ** -0.5

    def strategy_table(self, table: dict) -> tuple[dict, list[StrategyNote]]:
        """The ``[strategy]`` table to run and, when it differs from ``table``, a note for the log: under
        privacy, no ``strategy.name`` means fedavg (the default ``auto`` has no sensitivity bound), weighted by
        samples if ``weight_cap`` is set, else uniformly."""
        if not self.enabled or "name" in table or set(table) - DEFAULT_KEYS:
            return table, []
        weighting = table.get("weighting", "samples" if self.weight_cap else "uniform")
        note = (f"aggregation default under privacy: fedavg weighting={weighting} (the default auto picks Krum or "
                "centered clipping from un-noised updates; docs/privacy.md)")  # fmt: skip
        return {**table, "name": "fedavg", "weighting": weighting}, [StrategyNote(logging.INFO, note)]

    def check_compatible(self, strategy: dict, bounds: InfluencePolicy) -> None:
        """Refuse, naming the key, a configuration under which the noise would not give the guarantee."""
        if not self.enabled:
            return
        from flcore.strategies.capabilities import NO_BOUND, has_dp_bound, private_choices

        strategy = self.strategy_table(strategy)[0]
        built = build_strategy(strategy)
        if built.swaps:  # its swapped models are released noised (gaussian.release); its averages:
            self._check_swapping(built, strategy)
        elif not has_dp_bound(built, self.clip):
            why = built.why_not_private or NO_BOUND
            raise ValueError(f"privacy cannot run strategy.name = {built.name!r}: {why}. Use {private_choices()} "
                             "(docs/privacy.md)")  # fmt: skip
        else:
            self._check_weighting(built, strategy.get("weighting", "samples"))
        if strategy.get("late_weight", 0):
            raise ValueError("strategy.late_weight must be 0 with [privacy]: a late update folded into the next round "
                             "would be a second update of its agent there, beyond the sensitivity the noise covers")
        if bounds.clip == "off" or (bounds.clip == "fixed" and bounds.clip_norm != self.clip):
            raise ValueError(
                f"bounds.clip must be left at its default with [privacy]: every update is clipped to privacy.clip "
                f"= {self.clip}"
            )
        for key in ("max_change_norm", "max_update_norm"):
            if getattr(bounds, key) > 0:
                raise ValueError(
                    f"bounds.{key} must be 0 with [privacy]: it tests a value measured before the noise, and its "
                    "verdict would reveal it (every update is clipped to privacy.clip instead)"
                )

    def _check_swapping(self, built: Strategy, strategy: dict) -> None:
        """Swap rounds release each model with the round's clip S; average rounds must be a mean of the models
        (a robust aggregation's bound holds for clipped deltas, not for whole models)."""
        name, aggregate = built.name, built.options.aggregate
        if not STRATEGIES.get(aggregate).weighted:
            means = ", ".join(STRATEGIES.where(lambda kind: kind.weighted))
            raise ValueError(
                f"privacy needs strategy.aggregate = one of {means} with strategy {name!r}, "
                f"not {aggregate!r}: an average round's model must be the plain mean of the agents' models "
                "(docs/privacy.md, Model swapping)"
            )
        weighting_key, weighting = "weighting", strategy.get("weighting", "samples")
        if "weighting" in strategy.get("aggregate_options", {}):  # it overrides the swapping strategy's own
            weighting_key, weighting = "aggregate_options.weighting", strategy["aggregate_options"]["weighting"]
        if weighting != "uniform" or self.weight_cap:
            raise ValueError(
                f'privacy needs strategy.{weighting_key} = "uniform" (and no privacy.weight_cap) with strategy '
                f"{name!r}: a swapped model is released with noise of one agent's clip, whatever its weight"
            )
        if self.adaptive_clip:
            raise ValueError(
                f"privacy.adaptive_clip does not work with strategy {name!r}: its swap rounds release each agent's "
                "model with noise of the round's clip, which the adaptive clip's count would share; set a fixed "
                "privacy.clip"
            )

    def _check_weighting(self, built: Strategy, weighting: str) -> None:
        if not built.weighted:
            if self.weight_cap:
                raise ValueError(f"privacy.weight_cap weighs FedAvg's updates, and strategy {built.name} is "
                                 "unweighted: remove privacy.weight_cap")  # fmt: skip
        elif weighting == "samples" and not self.weight_cap:
            raise ValueError(
                'privacy with strategy.weighting = "samples" needs privacy.weight_cap: the samples (objects for '
                "detectors) at which an update counts fully, e.g. the median per agent (one with fewer counts "
                "proportionally less, one with more counts once), so that no agent outweighs the clip bound; or "
                'set strategy.weighting = "uniform"'
            )
        elif weighting != "samples" and self.weight_cap:
            raise ValueError(
                f'privacy.weight_cap caps sample weights, and strategy.weighting = "{weighting}" has none: remove '
                'privacy.weight_cap or set strategy.weighting = "samples"'
            )

    def configure(self, strategy: Strategy) -> None:
        """Under privacy, no update is folded early (the round's timing would count the clipped ones), no late
        update folded into the next round (one agent, one update a round: the noise's sensitivity), and
        weights are capped at ``weight_cap``."""
        strategy.fold_on_accept = not self.enabled
        if self.enabled:
            strategy.late_weight = 0.0
        strategy.weight_cap = self.weight_cap

    def bounds(self, policy: InfluencePolicy) -> InfluencePolicy:
        """The influence policy the round uses: every update clipped to exactly S, and no sample cap relative
        to the round's claims (one agent's claim would move every other weight; ``bounds.max_samples``, the
        same for every agent, stays)."""
        return replace(policy, clip="fixed", clip_norm=self.clip, sample_multiple=0) if self.enabled else policy
