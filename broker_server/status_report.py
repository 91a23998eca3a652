"""What the aggregator tells operators about itself: the retained ``server/status`` JSON (state, round,
phase, counters, disk and clock problems first) and the one-line systemd status. Mixed into the daemon
(``broker_server.daemon.Aggregator``); it reads the engine and registry and changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import paho.mqtt.client as paho

from protocol.messages import ServerStatus

if TYPE_CHECKING:
    from broker_server.daemon import Aggregator


class StatusReport:
    def publish_final_status(self: Aggregator) -> paho.MQTTMessageInfo | None:
        return self._publish_status(force=True, state=self._end_state() or "stopped")

    def systemd_status(self: Aggregator) -> str:
        disk = f"; {self.disk.problem}" if self.disk.problem else ""  # the state cannot be written: say it first
        return self._round_line() + disk

    def progress_fields(self: Aggregator) -> str:
        rs = self.engine.round_state
        round_ = rs.round if rs is not None else self.engine.next_round - 1
        return f"round={round_} model_version={self.engine.version}"

    def _round_line(self: Aggregator) -> str:
        rs = self.engine.round_state
        if self.engine.finished:
            why = ": the privacy budget is spent" if self.engine.budget_exhausted else ""
            return f"finished after round {self.engine.next_round - 1}{why}"
        if rs is None:
            eligible = self.registry.eligible(self.group_keys.key.key_id, self.clock())
            needed = self.config.rounds.min_agents
            return f"round {self.engine.next_round}: waiting for agents ({len(eligible)} eligible, {needed} needed)"
        attempt = f" (attempt {rs.attempt})" if rs.attempt > 1 else ""
        return f"round {rs.round}{attempt}: collecting {len(rs.updates)}/{len(rs.selected)} updates"

    def _status_json(self: Aggregator, state: str | None = None) -> bytes:
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
            phase="finished" if self.engine.finished else self.phase,  # also right after a restart
            strategy=self.engine.strategy.name,
            model_version=self.engine.version,
            agents_online=self.registry.online(self.clock()),
            updated_at=self.clock(),
            detail=detail,
            errors=self.errors,
            action=rs.action if rs is not None else "",
            best=self.engine.best.record,
            privacy=self.engine.ledger.summary() if self.config.privacy.enabled else {},
            eval=self.engine.model_eval,
        )
        self.prometheus.status(status, participants=len(rs.selected) if rs is not None else 0)
        return status.to_json()

    def _end_state(self: Aggregator) -> str:
        """``budget_exhausted`` or ``finished`` once the run is over, else empty."""
        if not self.engine.finished:
            return ""
        return "budget_exhausted" if self.engine.budget_exhausted else "finished"

    def _publish_status(
        self: Aggregator, *, force: bool = False, state: str | None = None
    ) -> paho.MQTTMessageInfo | None:
        now = self.clock()
        if not force and now - self._last_status < self.config.server.status_interval_s:
            return None
        self._last_status = now
        return self.mqtt.publish(self.topics.server_status, self._status_json(state), retain=True)
