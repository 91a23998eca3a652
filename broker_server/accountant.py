"""Per-agent privacy accounting for central DP (``broker_server.privacy``), with Google's dp-accounting.

Each round that added noise is, for every agent whose update it averaged, a Gaussian mechanism with
noise multiplier z; rounds compose, and the Rényi-DP accountant of dp-accounting
(``RdpAccountant``, Mironov 2017, arXiv:1702.07476) turns an agent's rounds into (ε, δ). An agent that
was not in a round is not charged for it: whether it is selected does not depend on its data.

No amplification by sampling is claimed. Sampling a fraction q of the agents per round would divide
the cost roughly by 1/q (DP-FedAvg's analysis), but that needs the sample to stay secret, and
SkyFed's signed round task names the selected agents to every subscriber of the ``round`` topic. So
the accounting is per agent, over the rounds it took part in, and the (ε, δ) reported is the largest
over agents: the guarantee every agent has. An agent whose next round would pass
``target_epsilon`` is not selected again; once fewer than ``rounds.min_agents`` can still afford a
round, the federation stops with ``budget_exhausted`` (docs/privacy.md).

The ledger is a count of charged rounds per agent and noise multiplier: small, exact, and kept in
the checkpoint, so a restart never forgets spent budget.
"""

from __future__ import annotations

from functools import lru_cache

import dp_accounting

from broker_server.privacy import PrivacyPolicy

PUBLIC_DETAIL = ("clip_bound", "work", "noise_std")


@lru_cache(maxsize=4096)
def epsilon_of(charges: tuple[tuple[float, int], ...], delta: float) -> float:
    """(ε at ``delta``) of Gaussian mechanisms composed: ``charges`` = ((noise multiplier, rounds), …)."""
    if not charges:
        return 0.0
    accountant = dp_accounting.rdp.RdpAccountant()
    for noise_multiplier, rounds in charges:
        accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)
    return float(accountant.get_epsilon(delta))


class PrivacyLedger:
    """Agent → {noise multiplier → rounds charged}."""

    def __init__(self, policy: PrivacyPolicy, charged: dict[str, dict[str, int]] | None = None) -> None:
        self.policy = policy
        self.charged = charged or {}

    def _charges(self, agent: str, extra: int = 0) -> tuple[tuple[float, int], ...]:
        counts = {float(z): n for z, n in self.charged.get(agent, {}).items()}
        if extra:
            counts[self.policy.noise_multiplier] = counts.get(self.policy.noise_multiplier, 0) + extra
        return tuple(sorted(counts.items()))

    def epsilon(self, agent: str) -> float:
        return epsilon_of(self._charges(agent), self.policy.delta)

    def affords_a_round(self, agent: str) -> bool:
        """Whether one more round keeps ``agent`` within ``target_epsilon`` (always, without a target)."""
        target = self.policy.target_epsilon
        return target <= 0 or epsilon_of(self._charges(agent, extra=1), self.policy.delta) <= target

    def affordable(self, agents: list[str]) -> list[str]:
        """Those of ``agents`` one more round keeps within ``target_epsilon``."""
        return [agent for agent in agents if self.affords_a_round(agent)]

    def charge(self, agents: list[str]) -> None:
        """A round with noise multiplier z averaged these agents' updates."""
        key = repr(self.policy.noise_multiplier)
        for agent in agents:
            per_agent = self.charged.setdefault(agent, {})
            per_agent[key] = per_agent.get(key, 0) + 1

    def summary(self) -> dict:
        """For ``privacy`` in status and metrics: the worst agent's ε and what it rests on."""
        worst = max(self.charged, key=self.epsilon, default=None)
        return {
            "epsilon": 0.0 if worst is None else round(self.epsilon(worst), 4),
            "delta": self.policy.delta,
            "target_epsilon": self.policy.target_epsilon or None,
            "noise_multiplier": self.policy.noise_multiplier,
            "clip": self.policy.clip,
            "max_rounds_per_agent": max((sum(c.values()) for c in self.charged.values()), default=0),
            "accounting": "per-agent RDP, user-level, no sampling amplification",
        }

    @staticmethod
    def public_detail(aggregation: dict) -> dict:
        """What ``metrics.aggregation`` may say under privacy: nothing measured on un-noised updates
        (their norms, who was clipped), only the bound and what the strategy decided before seeing them."""
        return {k: v for k, v in aggregation.items() if k in PUBLIC_DETAIL}

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {agent: dict(counts) for agent, counts in self.charged.items()}
