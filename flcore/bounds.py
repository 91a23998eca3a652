"""Bounded influence: no single agent can move the global model far or claim most of the weight.

Two bounds, both on by default (``[bounds]`` in server.toml; the policy is in security/README.md):

* **Norm clipping.** Each delta is scaled by ``min(1, C / ||delta||)``. ``clip = "adaptive"`` sets
  C = ``clip_multiple`` x the *lower* median L2 norm of the round's accepted updates, so it follows the
  scale of honest training and needs no tuning; ``"fixed"`` uses ``clip_norm``; ``"off"`` disables it.
  (Norm bounding as a defence: Sun et al., "Can You Really Backdoor Federated Learning?", 2019,
  arXiv:1911.07963.)
* **Sample weights.** A claimed sample count weighs at most ``sample_multiple`` x the round's lower
  median claim (and at most ``max_samples``, when set), so ``samples = 10**15`` buys a bounded share.
  Among few claims the multiple shrinks (``claim_multiple``): among n claims one at k x the lower median,
  the others at it, holds k / (k + n - 1) of the weight (half among three with k = 2), so k is at most
  (n - 1) / 2 (and at least 1): one claim buys at most a third of the weight, half of it between two.

The change a whole round makes is bounded too (``change_multiple``, ``flcore.change_bound``): norms
relative to the round follow its honest updates, and those grow without bound once the model in force
is bad, so a round's step is also held to the federation's own recent steps.

The lower median (the ceil(n/2)-th smallest value) is never above an honest value while honest agents
are a strict majority, and for two updates it is the smaller one: the plain median of two is their mean,
which a single large value drags up without bound (so a 2-update round would bound nothing).

Pure functions over arrays; the streaming fold uses the ``tentative`` variants, computed from the
updates accepted so far, and the aggregation step corrects to the exact round values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CLIP_MODES = ("adaptive", "fixed", "off")
MIN_REFERENCE = 3  # accepted updates before a running median is trusted for a tentative fold


@dataclass(frozen=True)
class InfluencePolicy:
    """``[bounds]`` of server.toml."""

    clip: str = "adaptive"
    clip_multiple: float = 2.0
    clip_norm: float = 0.0
    sample_multiple: float = 2.0
    max_samples: int = 0
    max_update_norm: float = 0.0
    max_change_norm: float = 0.0
    change_multiple: float = 3.0  # a round's step is shrunk to this x its recent steps' median (flcore.change_bound)
    collapse_ratio: float = 3.0  # a round whose evaluation loss passes this x the model in force's is rolled back
    screen_below: int = 7  # rounds of fewer updates are screened on the validation set (flcore.screening; 0 = off)

    def __post_init__(self) -> None:
        if self.clip not in CLIP_MODES:
            raise ValueError(f"bounds.clip must be one of {', '.join(CLIP_MODES)}, got {self.clip!r}")
        if self.clip == "adaptive" and self.clip_multiple < 1:
            raise ValueError(f"bounds.clip_multiple must be >= 1 (a multiple of the median), got {self.clip_multiple}")
        if self.clip == "fixed" and self.clip_norm <= 0:
            raise ValueError('bounds.clip_norm must be > 0 when bounds.clip = "fixed"')
        if self.sample_multiple != 0 and self.sample_multiple < 1:
            raise ValueError(f"bounds.sample_multiple must be 0 (off) or >= 1, got {self.sample_multiple}")
        for key in ("max_samples", "max_update_norm", "max_change_norm", "clip_norm", "screen_below"):
            if getattr(self, key) < 0:
                raise ValueError(f"bounds.{key} must be >= 0 (0 = off), got {getattr(self, key)}")
        for key in ("change_multiple", "collapse_ratio"):
            if getattr(self, key) != 0 and getattr(self, key) <= 1:
                raise ValueError(f"bounds.{key} must be 0 (off) or > 1, got {getattr(self, key)}")


@dataclass(frozen=True)
class Influence:
    """The round's exact bounds and, per accepted update (in order), its weight cap and clip scale."""

    clip_bound: float
    sample_cap: float
    samples: np.ndarray  # claimed samples, capped
    scales: np.ndarray  # min(1, clip_bound / norm)

    def describe(self, agents: list[str], claimed: np.ndarray, norms: np.ndarray) -> dict:
        """For ``metrics.aggregation``: the bounds and which agents they touched."""
        return {
            "clip_bound": self.clip_bound if math.isfinite(self.clip_bound) else None,
            "sample_cap": self.sample_cap if math.isfinite(self.sample_cap) else None,
            "clipped": [a for a, s in zip(agents, self.scales, strict=True) if s < 1],
            "capped": [a for a, c, n in zip(agents, self.samples, claimed, strict=True) if c < n],
            "median_norm": lower_median(norms) if len(norms) else None,
        }


def lower_median(values: np.ndarray) -> float:
    """The ceil(n/2)-th smallest value: bounded by an honest value under an honest strict majority."""
    return float(np.partition(values, (len(values) - 1) // 2)[(len(values) - 1) // 2])


def clip_bound(policy: InfluencePolicy, norms: np.ndarray) -> float:
    if policy.clip == "off" or (policy.clip == "adaptive" and len(norms) == 0):
        return math.inf
    if policy.clip == "fixed":
        return policy.clip_norm
    return policy.clip_multiple * lower_median(norms)


def claim_multiple(policy: InfluencePolicy, claims: int) -> float:
    """The multiple of the lower median claim that one of ``claims`` claims may weigh: ``sample_multiple``,
    shrunk among few claims so that none buys more than a third of the weight (half of it between two)."""
    return min(policy.sample_multiple, max(1.0, (claims - 1) / 2))


def sample_cap(policy: InfluencePolicy, samples: np.ndarray) -> float:
    cap = float(policy.max_samples) if policy.max_samples > 0 else math.inf
    if policy.sample_multiple > 0 and len(samples):
        cap = min(cap, claim_multiple(policy, len(samples)) * lower_median(samples))
    return cap


def bound_influence(policy: InfluencePolicy, norms: np.ndarray, samples: np.ndarray) -> Influence:
    """Exact bounds for a round from all its accepted updates' norms and claimed sample counts."""
    bound = clip_bound(policy, norms)
    cap = sample_cap(policy, samples)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(norms > bound, bound / norms, 1.0) if len(norms) else np.ones(0)
    return Influence(bound, cap, np.minimum(samples.astype(np.float64), cap), scales.astype(np.float64))


@dataclass(frozen=True)
class Tentative:
    """What the streaming fold may assume before the round is over: fold an update only if its norm
    stays within ``max_norm`` and with its samples capped at ``samples`` (None: do not fold yet)."""

    max_norm: float
    samples: float | None


def tentative(policy: InfluencePolicy, norms_so_far: np.ndarray, samples_so_far: np.ndarray, samples: int) -> Tentative:
    """Bounds from the updates accepted so far (the new one's claim included, its norm not yet known)."""
    if policy.clip == "adaptive":
        max_norm = clip_bound(policy, norms_so_far) if len(norms_so_far) >= MIN_REFERENCE else 0.0
    else:
        max_norm = clip_bound(policy, norms_so_far)
    if policy.max_update_norm > 0:
        max_norm = min(max_norm, policy.max_update_norm)
    claims = np.append(samples_so_far, samples)
    if policy.sample_multiple > 0 and len(claims) < MIN_REFERENCE:
        return Tentative(max_norm, None)
    return Tentative(max_norm, min(float(samples), sample_cap(policy, claims)))
