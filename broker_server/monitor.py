"""``skyfed monitor``: a live terminal view of one federation, built only from its status topics.

It reads exactly what any operator could read with ``mosquitto_sub -v -t 'skyfed/<fed>/#'`` (retained
server and agent status, per-round metrics) and needs no keys: status is public by design.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from protocol.messages import AgentStatus, MessageError, RoundMetrics, ServerStatus, headline
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import Topics


@dataclass
class FederationView:
    """What the monitor knows so far; ``apply`` folds in one received message."""

    topics: Topics
    server: ServerStatus | None = None
    agents: dict[str, AgentStatus] = field(default_factory=dict)
    metrics: list[RoundMetrics] = field(default_factory=list)

    def apply(self, topic: str, payload: bytes) -> None:
        try:
            if topic == self.topics.server_status and payload:
                self.server = ServerStatus.from_json(payload)
            elif topic == self.topics.server_metrics:
                self.metrics = [*self.metrics[-9:], RoundMetrics.from_json(payload)]
            elif (agent := self.topics.agent_of(topic)) and topic == self.topics.agent_status(agent) and payload:
                self.agents[agent] = AgentStatus.from_signed_json(payload)  # as claimed: the monitor holds no keys
        except MessageError:
            pass

    def render(self) -> Group:
        """Tables of the last status and metrics; every value from the network is shown as plain text."""
        s = self.server
        head = Table(title=Text(f"SkyFed federation {self.topics.federation!r}"), show_header=True)
        for col in ("server", "round", "phase", "strategy", "model", "agents online", "rejections"):
            head.add_column(col, overflow="fold")
        if s is not None:
            phase = f"{s.phase} ({s.action})" if s.action not in ("", "average") else s.phase
            model = f"v{s.model_version}" + (f", best v{s.best['version']}" if s.best.get("version") else "")
            strategy = s.strategy
            if s.privacy:  # differential privacy: what the worst-off agent has spent
                strategy += f", ε {s.privacy.get('epsilon')} of {s.privacy.get('target_epsilon') or '∞'}"
            head.add_row(*_cells(s.state, s.round, phase, strategy, model, s.agents_online, s.detail))
        agents = Table(show_header=True)
        for col in ("agent", "state", "round", "done", "samples", "model", "gate", "age s"):
            agents.add_column(col, overflow="fold")
        agents.add_column("detail", overflow="fold", ratio=1, min_width=30)
        now = time.time()
        for name, a in sorted(self.agents.items()):
            gate = "ok" if a.gate.ok else "blocked: " + ", ".join(a.gate.reasons)
            state = f"{a.state} (from {a.start})" if a.start not in ("", "global") else a.state
            agents.add_row(
                *_cells(name, state, a.round, a.last_completed_round, a.samples, f"v{a.version}", gate)
                + _cells(f"{now - a.updated_at:.0f}", a.detail)
            )
        rounds = Table(show_header=True)
        for col in ("round", "accepted", "rejected", "accuracy/mAP50", "loss", "seconds", "MB up", "MB down"):
            rounds.add_column(col)
        for m in self.metrics:
            outcome = "" if m.outcome == "committed" else f" ({m.outcome}: {m.reason})"
            outcome += "" if m.action == "average" else f" {m.action}"
            rounds.add_row(
                *_cells(
                    f"{m.round}{outcome}",
                    f"{len(m.accepted)}/{len(m.participants)}",
                    len(m.rejected),
                    _fmt(headline(m.eval)),
                    _fmt(m.eval.get("loss")),
                    f"{m.duration_s:.1f}",
                    f"{m.bytes_up / 1e6:.2f}",
                    f"{m.bytes_down / 1e6:.2f}",
                )
            )
        if not self.metrics:
            return Group(head, agents, "no round has finished since the monitor started (metrics are not retained)")
        return Group(head, agents, rounds)


MAX_CELL = 800  # characters of one network-supplied value shown (an agent's detail names a fix)


def _cells(*values: object) -> list[Text]:
    """Plain text cells: a status string such as ``[/oops]`` is shown, never parsed as markup."""
    return [Text(str(v)[:MAX_CELL]) for v in values]


def _fmt(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-"


def monitor(settings: BrokerSettings, federation: str, *, once: bool = False, timeout_s: float = 3.0) -> int:
    view = FederationView(Topics(federation))
    client = MqttClient(f"monitor-{uuid.uuid4().hex[:8]}", settings, persistent=False)
    for pattern in (view.topics.server_status, view.topics.server_metrics, view.topics.agent_status_wildcard):
        client.subscribe(pattern, qos=0)
    if not client.start(timeout_s=timeout_s):
        Console(stderr=True).print(f"cannot reach the broker at {settings.host}:{settings.port}")
        client.stop()
        return 1
    try:
        if once:
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if (msg := client.poll(left)) is not None:
                    view.apply(*msg)
            Console().print(view.render())
            return 0
        with Live(view.render(), refresh_per_second=2) as live:
            while True:
                if (msg := client.poll(0.5)) is not None:
                    view.apply(*msg)
                live.update(view.render())
    except KeyboardInterrupt:
        return 0
    finally:
        client.stop()
