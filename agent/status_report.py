"""What the agent tells the server and operators about itself: the signed, retained status (state, round,
gate and its reasons, what it waits for) and the one-line systemd status. A collaborator of the agent's role
(``agent.daemon.EdgeAgent``), published through its edge node (``agent.edge_node``), at most every
``agent.status_interval_s`` unless a change forces it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import paho.mqtt.client as paho

from agent.waiting import waiting_for
from protocol.messages import AgentStatus, Gate

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from agent.edge_node import EdgeNode
    from agent.inbox import ServerInbox
    from agent.profile import DataProfile, PrivacyView
    from agent.run_end import RunEnd
    from models.weights import NamedArrays
    from participant.round_client import RoundClient
    from protocol.messages import RoundTask
    from protocol.topics import Topics
    from security.keys import GroupKey


class ReportedAgent(Protocol):
    """What the report reads of its agent (``agent.daemon.EdgeAgent``), each when it reports: typed here, so the
    report never imports the agent that holds it."""

    config: AgentConfig
    id: str
    topics: Topics
    edge: EdgeNode
    inbox: ServerInbox
    client: RoundClient
    run_end: RunEnd
    profile: DataProfile
    privacy: PrivacyView | None
    task: RoundTask | None
    state: str
    detail: str
    refusal: str

    @property
    def group_keys(self) -> dict[str, GroupKey]: ...

    @property
    def models(self) -> dict[int, NamedArrays]: ...


class StatusReport:
    def __init__(self, agent: ReportedAgent) -> None:
        self.agent = agent
        self.interval_s = agent.config.agent.status_interval_s
        self.last = 0.0  # when the last status went out (0: the next one goes out whatever the interval)

    def describe(self) -> str:
        """``round 3: training``, ``round 3: gated (armed: …)``, ``no round yet: idle`` (what systemctl shows)."""
        a = self.agent
        where = f"round {a.task.round}" if a.task is not None else "no round yet"
        why = f" ({'; '.join(a.edge.telemetry.reasons())})" if a.state == "gated" else ""
        return f"{where}: {a.state}{why}" + ("; the server's run is over" if a.run_end.ended else "")

    def waiting_for(self) -> str:
        a = self.agent
        return waiting_for(agent=a.id, topics=a.topics, key_mismatch=a.inbox.key_mismatch,
                           has_group_key=bool(a.group_keys), task=a.task, state=a.state)  # fmt: skip

    def gate_reasons(self) -> list[str]:
        """The device's gate, its local privacy budget and its data profile (what the server selects on)."""
        a = self.agent
        refusal = a.privacy.refusal() if a.privacy is not None else ""
        return [*a.edge.telemetry.reasons(), *(r for r in (refusal, a.refusal) if r)]

    def status(self) -> AgentStatus:
        a, edge = self.agent, self.agent.edge
        task = a.task
        gate_reasons = self.gate_reasons()
        skew = f"clock skew: {edge.clock.offset_s:+.0f} s off the server's clock" if edge.clock.skewed else ""
        state, detail = edge.connection_state(a.state, a.detail or skew or a.run_end.detail() or self.waiting_for())
        return AgentStatus(
            agent=a.id,
            state=state,
            round=task.round if task else 0,
            run_id=task.run_id if task else "",
            task_version=task.model_version if task else 0,
            receipt=task.receipt if task else "",
            samples=a.profile.samples,
            version=max(a.models, default=0),
            updated_at=time.time(),
            gate=Gate(ok=not gate_reasons, reasons=gate_reasons),
            group_key_id=next(reversed(a.group_keys), ""),
            last_completed_round=a.client.progress.last_completed_round,
            detail=detail,
            errors=edge.errors,
            session=edge.session,
            clock_offset_s=round(edge.clock.offset_s, 1),
            start=task.start_of(a.id).source if task and a.id in task.selected else "",
            privacy=a.privacy.summary() if a.privacy is not None else {},
        )

    def publish(self, *, force: bool = False) -> paho.MQTTMessageInfo | None:
        now = time.time()
        if not force and now - self.last < self.interval_s:
            return None
        self.last = now
        return self.agent.edge.publish_status(self.status().to_dict())  # the server selects on signed status only
