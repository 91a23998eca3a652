"""Every refusal the aggregator makes ends here: a reason in the log (throttled per agent and kind), the counters
in ``server/status`` and Prometheus, and the round's ``metrics.rejected`` (``RoundEngine.reject``). Ids that are
not enrolled (anyone can invent topic ids) share one log key and one metrics entry per kind, so junk cannot
crowd out real agents. ``Aggregator.refusals``.
"""

from __future__ import annotations

import logging
from collections import Counter

from broker_server.agents.registry import AgentRegistry
from broker_server.pool import POOL
from broker_server.rounds.engine import RoundEngine
from broker_server.watch.prometheus import ServerMetrics
from common.logs import Throttle
from common.text import printable
from flcore.validation import reason_kind

log = logging.getLogger("skyfed.server")

NOT_ENROLLED = "(not enrolled)"
RE_ENROL = "not signed by the key enrolled for this agent: if its key was re-made, re-enrol this agent"
REJECTION_LOG_INTERVAL_S = 10.0


class Refusals:
    """``counts``: refusals by kind (the server status shows them); ``pool``: whether ``server-pool`` is ours."""

    def __init__(self, engine: RoundEngine, *, registry: AgentRegistry, counts: Counter[str],
                 prometheus: ServerMetrics, pool: bool) -> None:  # fmt: skip
        self.engine, self.registry, self.counts, self.prometheus, self.pool = engine, registry, counts, prometheus, pool
        self._log = Throttle(REJECTION_LOG_INTERVAL_S)

    def refuse(self, agent: str, reason: str) -> None:
        """Count, log (throttled) and record a refusal."""
        reason = printable(reason)
        kind = reason_kind(reason)
        self.counts[kind] += 1
        self.prometheus.update_rejected(kind)
        enrolled = agent in self.registry.keyring or (agent == POOL and self.pool)
        if enrolled and kind == "bad-signature":
            reason = f"bad-signature: {RE_ENROL}"
        held = self._log.allow(f"{agent if enrolled else '*'}:{kind}")
        if held is not None:
            log.warning("rejected agent=%s reason=%s held_back=%d", printable(agent, 64), reason, held)
        self.engine.reject(agent if enrolled else NOT_ENROLLED, reason if enrolled else kind)
