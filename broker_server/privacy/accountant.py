"""Per-agent privacy accounting for central DP (``broker_server.privacy.policy``), with Google's dp-accounting.

Each round that reached aggregation is, for every agent whose update it averaged (or refused on its
values), a Gaussian mechanism with noise multiplier z; rounds compose, and the Rényi-DP accountant of
dp-accounting (``RdpAccountant``, Mironov 2017, arXiv:1702.07476; neighbouring relation
``REPLACE_SPECIAL``: one agent's update replaced by zero) turns an agent's rounds into (ε, δ). An agent
that was not in a round is not charged for it: whether it is selected does not depend on its data.

No amplification by sampling is claimed. Sampling a fraction q of the agents per round would divide
the cost roughly by 1/q (DP-FedAvg's analysis), but that needs the sample to stay secret, and
SkyFed's signed round task names the selected agents to every subscriber of the ``round`` topic. So
the accounting is per agent, over the rounds it took part in, and the (ε, δ) reported is the largest
over agents: the guarantee every agent has. An agent whose next round would pass
``target_epsilon`` is not selected again; once fewer than ``rounds.min_agents`` enrolled agents can
still afford a round, the federation stops with ``budget_exhausted`` (docs/privacy.md).

The ledger (rounds charged per agent and noise multiplier, and how many models were published
without privacy) is kept in the checkpoint whether privacy is on or not, so neither a restart nor
switching ``[privacy]`` off and on again forgets spent budget. A model published without the noise
makes every later ε infinite: privacy must be on from a fresh state.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from broker_server.privacy.dp_epsilon import epsilon_of
from broker_server.privacy.policy import PrivacyPolicy
from flcore.validation import reason_kind
from protocol.messages import Rejection, RoundMetrics

log = logging.getLogger("skyfed.server")
PUBLIC_DETAIL = ("clip_bound", "work", "noise_std", "unclipped_fraction", "next_clip")


class PrivacyLedger:
    """Agent → {noise multiplier → rounds charged}, and the count of models published without noise."""

    def __init__(self, policy: PrivacyPolicy, record: dict | None = None) -> None:
        self.policy = policy
        record = record or {}
        self.charged: dict[str, dict[str, int]] = record.get("charged", {})
        self.unprotected_rounds: int = record.get("unprotected_rounds", 0)
        # the clip of the next round: adapted from round to round (broker_server.privacy.adaptive_clip), else fixed
        self.clip: float = record.get("clip", policy.clip) if policy.adaptive_clip else policy.clip
        if policy.enabled and self.unprotected_rounds:
            log.warning("privacy is on, but this state published %d models without it: no agent has a finite "
                        "epsilon; start from a fresh server.state_dir", self.unprotected_rounds)  # fmt: skip

    def _charges(self, agent: str, extra: int = 0) -> tuple[tuple[float, int], ...]:
        counts = {float(z): n for z, n in self.charged.get(agent, {}).items()}
        if extra:
            counts[self.policy.noise_multiplier] = counts.get(self.policy.noise_multiplier, 0) + extra
        return tuple(sorted(counts.items()))

    def epsilon(self, agent: str) -> float:
        if self.unprotected_rounds:
            return math.inf
        return epsilon_of(self._charges(agent), self.policy.delta)

    def affords_a_round(self, agent: str) -> bool:
        """Whether one more round keeps ``agent`` within ``target_epsilon`` (always, without a target)."""
        target = self.policy.target_epsilon
        if target <= 0:
            return True
        return not self.unprotected_rounds and epsilon_of(self._charges(agent, extra=1), self.policy.delta) <= target

    def affordable(self, agents: list[str]) -> list[str]:
        """Those of ``agents`` one more round keeps within ``target_epsilon``."""
        return [agent for agent in agents if self.affords_a_round(agent)]

    def after_round(self, agents: list[str], *, published: bool, next_clip: float = 0.0) -> None:
        """A round averaged (or refused on their values) these agents' updates: charge them under
        privacy, and take the adaptive clip's ``next_clip`` (0: unchanged); without privacy, count a
        published model as unprotected."""
        if not self.policy.enabled:
            self.unprotected_rounds += int(published)
            return
        if next_clip > 0:
            self.clip = next_clip
        key = repr(self.policy.noise_multiplier)
        for agent in agents:
            per_agent = self.charged.setdefault(agent, {})
            per_agent[key] = per_agent.get(key, 0) + 1

    def summary(self) -> dict:
        """For ``privacy`` in status and metrics: the worst agent's ε and what it rests on."""
        worst = max(self.charged, key=self.epsilon, default=None)
        epsilon = math.inf if self.unprotected_rounds else 0.0 if worst is None else round(self.epsilon(worst), 4)
        return {
            "epsilon": epsilon,  # infinite (null in JSON) once a model went out without noise
            "delta": self.policy.delta,
            "target_epsilon": self.policy.target_epsilon or None,
            "noise_multiplier": self.policy.noise_multiplier,
            "clip": self.clip,  # the next round's (adaptive_clip: it moves; each round's is metrics' clip_bound)
            "adaptive_clip": self.policy.adaptive_clip,
            "max_rounds_per_agent": max((sum(c.values()) for c in self.charged.values()), default=0),
            "unprotected_rounds": self.unprotected_rounds,
            "accounting": "per-agent RDP, user-level, no sampling amplification",
        }

    def public_metrics(self, metrics: RoundMetrics, noise_std: float) -> RoundMetrics:
        """A round's metrics as they may be published under privacy: nothing measured on un-noised
        updates (norms, who was clipped, the numbers in refusal reasons, which agents dominated a
        roll-back, how long aggregating took) or on an agent's own data outside the accounting (its
        C-SPE: only the server's C-GEN of the published model is kept), plus the noise and the budget."""
        detail = {k: v for k, v in {**metrics.aggregation, "noise_std": noise_std}.items() if k in PUBLIC_DETAIL}
        return replace(
            metrics,
            aggregation=detail,
            rejected=[Rejection(r.agent, reason_kind(r.reason)) for r in metrics.rejected],
            reason=reason_kind(metrics.reason),
            offenders=[],
            aggregate_s=0.0,
            privacy=self.summary(),
            personal={k: metrics.personal[k] for k in ("c_gen", "scored")} if "c_gen" in metrics.personal else {},
        )

    def to_dict(self) -> dict:
        return {
            "charged": {agent: dict(c) for agent, c in self.charged.items()},
            "unprotected_rounds": self.unprotected_rounds,
            "clip": self.clip,
        }
