"""An edge node's Prometheus metrics (``[metrics] prometheus_port`` in agent.toml; docs/monitoring.md lists them).

The shell (``agent.edge_node``) reports its role's standing after every tick, and the role each update the
broker acknowledged; all of it on the loop thread, the HTTP thread only reads (``protocol.prometheus``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from protocol.prometheus import MetricsSection, serve

if TYPE_CHECKING:
    from agent.standing import Standing


class AgentMetrics:
    def __init__(self, section: MetricsSection, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.training = Counter("skyfed_agent_training_seconds", "Time spent training (each stretch counted when it "
                                "ends: trained, cancelled, declined or failed)", registry=r)  # fmt: skip
        self.gate_open = Gauge("skyfed_agent_gate_open", "1 while the gate lets this agent train, 0 while it is "
                               "closed (skyfed_agent_gate_reasons says how many reasons)", registry=r)  # fmt: skip
        self.gate_reasons = Gauge("skyfed_agent_gate_reasons", "How many reasons keep the gate closed", registry=r)
        self.sent = Counter("skyfed_agent_sent_bytes", "Sealed update bytes the broker acknowledged", registry=r)
        self.updates = Counter("skyfed_agent_updates_sent", "Updates the broker acknowledged", registry=r)
        self.last_round = Gauge("skyfed_agent_last_completed_round", "The last round this agent completed",
                                registry=r)  # fmt: skip
        self.round = Gauge("skyfed_agent_round", "The round of the newest task this agent holds", registry=r)
        self._training_since: float | None = None
        self.endpoint = serve(section, self.registry)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()

    def observe(self, standing: Standing) -> None:
        """Where the role stands now: time in ``training`` is counted once it leaves it."""
        now = self.clock()
        if standing.state == "training" and self._training_since is None:
            self._training_since = now
        elif standing.state != "training" and self._training_since is not None:
            self.training.inc(now - self._training_since)
            self._training_since = None
        self.gate_open.set(not standing.gate)
        self.gate_reasons.set(len(standing.gate))
        self.last_round.set(standing.last_completed_round)
        self.round.set(standing.round)

    def update_sent(self, size: int) -> None:
        self.updates.inc()
        self.sent.inc(size)
