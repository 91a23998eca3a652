"""What the agent tells the server and operators about itself: the signed, retained status (state, round,
gate and its reasons, what it waits for) and the one-line systemd status. Mixed into the daemon
(``agent.daemon.EdgeAgent``); publishing a status also updates its Prometheus gauges (``agent.prometheus``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import paho.mqtt.client as paho

from agent.waiting import waiting_for
from protocol.messages import AgentStatus, Gate
from security.signing import signed_payload

if TYPE_CHECKING:
    from agent.daemon import EdgeAgent


class StatusReport:
    def systemd_status(self: EdgeAgent) -> str:
        """``round 3: training``, ``round 3: gated (armed: …)``, ``no round yet: idle`` (what systemctl shows)."""
        where = f"round {self.task.round}" if self.task is not None else "no round yet"
        why = f" ({'; '.join(self.telemetry.reasons())})" if self.state == "gated" else ""
        return f"{where}: {self.state}{why}" + ("; the server's run is over" if self.run_end.ended else "")

    def progress_fields(self: EdgeAgent) -> str:
        return f"round={self.task.round if self.task is not None else 0} model_version={max(self.models, default=0)}"

    def _waiting_for(self: EdgeAgent) -> str:
        return waiting_for(agent=self.id, topics=self.topics, key_mismatch=self.inbox.key_mismatch,
                           has_group_key=bool(self.group_keys), task=self.task, state=self.state)  # fmt: skip

    def _status(self: EdgeAgent) -> AgentStatus:
        task = self.task
        refusal = self.privacy.refusal() if self.privacy is not None else ""
        gate_reasons = [*self.telemetry.reasons(), *(r for r in (refusal, self.refusal) if r)]
        skew = f"clock skew: {self.clock.offset_s:+.0f} s off the server's clock" if self.clock.skewed else ""
        state, detail = self.connection_state(
            self.state, self.detail or skew or self.run_end.detail() or self._waiting_for()
        )
        return AgentStatus(
            agent=self.id,
            state=state,
            round=task.round if task else 0,
            run_id=task.run_id if task else "",
            task_version=task.model_version if task else 0,
            receipt=task.receipt if task else "",
            samples=self.profile.samples,
            version=max(self.models, default=0),
            updated_at=time.time(),
            gate=Gate(ok=not gate_reasons, reasons=gate_reasons),
            group_key_id=next(reversed(self.group_keys), ""),
            last_completed_round=self.client.progress.last_completed_round,
            detail=detail,
            errors=self.errors,
            session=self.session,
            clock_offset_s=round(self.clock.offset_s, 1),
            start=task.start_of(self.id).source if task and self.id in task.selected else "",
            privacy=self.privacy.summary() if self.privacy is not None else {},
        )

    def _publish_status(self: EdgeAgent, *, force: bool = False) -> paho.MQTTMessageInfo | None:
        now = time.time()
        if not force and now - self._last_status < self.config.agent.status_interval_s:
            return None
        self._last_status = now
        status = self._status()
        self.prometheus.status(status)
        payload = signed_payload(status.to_dict(), self.identity)  # the server selects on signed status only
        self.echo.sent(payload)
        return self.mqtt.publish(self.topics.agent_status(self.id), payload, retain=True)
