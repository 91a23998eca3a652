"""What the aggregator tells operators about itself: the retained ``server/status`` JSON (state, round,
phase, counters, disk and clock problems first) and the one-line systemd status. ``Aggregator.report``; it
reads the engine and registry and changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import paho.mqtt.client as paho

from broker_server.agents.groupkeys import GroupKeyDistributor
from broker_server.agents.registry import AgentRegistry
from broker_server.config import ServerConfig
from broker_server.rounds.disk import DiskWatch
from broker_server.rounds.engine import RoundEngine
from broker_server.watch.prometheus import ServerMetrics
from protocol.messages import ServerStatus
from protocol.mqtt import MqttClient
from protocol.topics import Topics


class StatusReport:
    """``phase`` and ``errors`` read the daemon's (``Aggregator.phase``, ``MqttDaemon.errors``);
    ``connection_state`` puts the broker's problem first (``MqttDaemon.connection_state``)."""

    def __init__(self, config: ServerConfig, engine: RoundEngine, *, registry: AgentRegistry,
                 group_keys: GroupKeyDistributor, disk: DiskWatch, rejections: Counter[str], mqtt: MqttClient,
                 topics: Topics, prometheus: ServerMetrics, clock: Callable[[], float], phase: Callable[[], str],
                 errors: Callable[[], int],
                 connection_state: Callable[[str, str], tuple[str, str]]) -> None:  # fmt: skip
        self.config, self.engine, self.registry, self.group_keys = config, engine, registry, group_keys
        self.disk, self.rejections, self.mqtt, self.topics = disk, rejections, mqtt, topics
        self.prometheus, self.clock, self.phase, self.errors = prometheus, clock, phase, errors
        self.connection_state = connection_state
        self.last_published = 0.0  # 0: publish on the next tick (after a (re)connect, say)

    def publish_final(self) -> paho.MQTTMessageInfo | None:
        return self.publish(force=True, state=self._end_state() or "stopped")

    def systemd_line(self) -> str:
        disk = f"; {self.disk.problem}" if self.disk.problem else ""  # the state cannot be written: say it first
        return self._round_line() + disk

    def progress_fields(self) -> str:
        rs = self.engine.round_state
        round_ = rs.round if rs is not None else self.engine.next_round - 1
        return f"round={round_} model_version={self.engine.version}"

    def _round_line(self) -> str:
        rs = self.engine.round_state
        if self.engine.finished:
            why = ": the privacy budget is spent" if self.engine.budget_exhausted else ""
            return f"finished after round {self.engine.next_round - 1}{why}"
        if rs is None:
            eligible = self.registry.eligible(self.group_keys.key.key_id, self.clock())
            needed = self.config.rounds.min_agents
            return f"round {self.engine.next_round}: waiting for agents ({len(eligible)} eligible, {needed} needed)"
        attempt = f" (attempt {rs.attempt})" if rs.attempt > 1 else ""
        if self.config.rounds.is_async:
            buffer = self.engine.buffer.status()
            return (f"version {self.engine.version}: buffer {buffer['filled']}/{buffer['size']} updates, "
                    f"{buffer['in_flight']} agents training")  # fmt: skip
        return f"round {rs.round}{attempt}: collecting {len(rs.updates)}/{len(rs.selected)} updates"

    def json(self, state: str | None = None) -> bytes:
        rs = self.engine.round_state
        counters = [f"{k}={v}" for k, v in sorted(self.rejections.items())]
        if self.disk.problem:  # the state cannot be written: the first thing an operator must know
            counters.insert(0, self.disk.problem)
        backed_off = self.engine.health.backed_off(self.engine.next_round, self.clock())
        if backed_off:  # agents that missed deadlines, with their consecutive misses
            counters.append("backed_off=" + " ".join(f"{a}:{n}" for a, n in backed_off.items()))
        if skewed := self.registry.clock_offsets():
            counters.append("clock_skew=" + " ".join(f"{a}:{o:+.0f}s" for a, o in skewed.items()))
        if self.engine.budget_exhausted:
            counters.insert(0, f"privacy budget spent: too few agents can afford a round within epsilon "
                               f"{self.config.privacy.target_epsilon:g}; the last model is final")  # fmt: skip
        state, detail = self.connection_state(state or self._end_state() or "running", ", ".join(counters))
        status = ServerStatus(
            state=state,
            federation=self.topics.federation,
            round=rs.round if rs is not None else self.engine.next_round - 1,
            phase="finished" if self.engine.finished else self.phase(),  # also right after a restart
            strategy=self.engine.strategy.name,
            model_version=self.engine.version,
            agents_online=self.registry.online(self.clock()),
            updated_at=self.clock(),
            detail=detail,
            errors=self.errors(),
            action=rs.action if rs is not None else "",
            best=self.engine.best.record,
            privacy=self.engine.ledger.summary() if self.config.privacy.enabled else {},
            eval=self.engine.model_eval,
            buffer=self.engine.buffer.status() if self.config.rounds.is_async else {},
        )
        self.prometheus.status(status, participants=len(rs.selected) if rs is not None else 0)
        return status.to_json()

    def _end_state(self) -> str:
        """``budget_exhausted`` or ``finished`` once the run is over, else empty."""
        if not self.engine.finished:
            return ""
        return "budget_exhausted" if self.engine.budget_exhausted else "finished"

    def publish(self, *, force: bool = False, state: str | None = None) -> paho.MQTTMessageInfo | None:
        now = self.clock()
        if not force and now - self.last_published < self.config.server.status_interval_s:
            return None
        self.last_published = now
        return self.mqtt.publish(self.topics.server_status, self.json(state), retain=True)
