"""``skyfed monitor``: a live terminal view of one federation, built only from its status topics.

It reads exactly what any operator could read with ``mosquitto_sub -v -t 'skyfed/<fed>/#'`` (retained
server and agent status, per-round metrics) and needs no keys: status is public by design.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from common.text import printable
from protocol.messages import AgentStatus, MessageError, RoundMetrics, ServerStatus, headline
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import ROOT, Topics

ANY_SERVER_STATUS = f"{ROOT}/+/server/status"  # which federations a broker carries, asked when ours shows nothing
DISCOVERY_S = 1.5  # retained status arrives at once; this is ample
STOP_WAIT_S = 1.0  # paho's thread may be mid-reconnect: the monitor exits without it
# the broker names a TLS client by its certificate: every watcher needs its own (docs/monitoring.md)
TAKEN_OVER_FIX = ("this monitor stops rather than take the connection back: run one skyfed monitor per certificate, "
                  "and mosquitto_sub with DIR/monitor/monitor-sub.crt (skyfed provision writes it)")  # fmt: skip
PIPE_WIDTH = 200  # columns of a --once snapshot into a file or pipe (rich would cut it at 80)


@dataclass
class FederationView:
    """What the monitor knows so far; ``apply`` folds in one received message."""

    topics: Topics
    server: ServerStatus | None = None
    agents: dict[str, AgentStatus] = field(default_factory=dict)
    metrics: list[RoundMetrics] = field(default_factory=list)

    hint: str = ""  # shown under the tables, e.g. which federations the broker carries when this one is silent

    @property
    def empty(self) -> bool:
        return self.server is None and not self.agents and not self.metrics

    def apply(self, topic: str, payload: bytes) -> str | None:
        """Fold in one message; return it as one plain line (for a pipe or a log), or None if ignored."""
        try:
            if topic == self.topics.server_status and payload:
                self.server = ServerStatus.from_json(payload)
                return _server_line(self.server)
            if topic == self.topics.server_metrics:
                self.metrics = [*self.metrics[-9:], RoundMetrics.from_json(payload)]
                return _metrics_line(self.metrics[-1])
            if (agent := self.topics.agent_of(topic)) and topic == self.topics.agent_status(agent) and payload:
                self.agents[agent] = AgentStatus.from_signed_json(payload)  # as claimed: the monitor holds no keys
                return _agent_line(agent, self.agents[agent])
        except MessageError:
            pass
        return None

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
        for col in ("round", "accepted", "rejected", "accuracy/mAP50", "C-SPE", "C-GEN", "loss", "seconds", "MB up",
                    "MB down"):  # fmt: skip
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
                    _fmt(m.personal.get("c_spe")),
                    _fmt(m.personal.get("c_gen")),
                    _fmt(m.eval.get("loss")),
                    f"{m.duration_s:.1f}",
                    f"{m.bytes_up / 1e6:.2f}",
                    f"{m.bytes_down / 1e6:.2f}",
                )
            )
        notes = [Text(self.hint)] if self.hint else []
        if not self.metrics:
            notes.append(Text("no round has finished since the monitor started (metrics are not retained)"))
            return Group(head, agents, *notes)
        return Group(head, agents, rounds, *notes)


MAX_CELL = 800  # characters of one network-supplied value shown (an agent's detail names a fix)


def _cells(*values: object) -> list[Text]:
    """Plain text cells: a status string such as ``[/oops]`` is shown, never parsed as markup, and an escape
    sequence in it (clipboard write, screen clear, concealed text) is shown escaped, never sent to the terminal."""
    return [Text(printable(str(v), MAX_CELL)) for v in values]


def _line(kind: str, **fields: object) -> str:
    """``kind key=value ...``, every value one printable token run (a pipe or journald gets one line each)."""
    return " ".join([kind, *(f"{k}={printable(str(v), MAX_CELL)}" for k, v in fields.items())])


def _server_line(s: ServerStatus) -> str:
    return _line("server", federation=s.federation, state=s.state, round=s.round, phase=s.phase,
                 strategy=s.strategy, model=f"v{s.model_version}", agents_online=s.agents_online,
                 eval=_fmt(headline(s.eval)), detail=s.detail)  # fmt: skip


def _agent_line(name: str, a: AgentStatus) -> str:
    gate = "ok" if a.gate.ok else "blocked: " + ", ".join(a.gate.reasons)
    return _line("agent", id=name, state=a.state, round=a.round, done=a.last_completed_round, samples=a.samples,
                 model=f"v{a.version}", gate=gate, detail=a.detail)  # fmt: skip


def _metrics_line(m: RoundMetrics) -> str:
    return _line("round", round=m.round, outcome=m.outcome, reason=m.reason,
                 accepted=f"{len(m.accepted)}/{len(m.participants)}", rejected=len(m.rejected),
                 metric=_fmt(headline(m.eval)), c_spe=_fmt(m.personal.get("c_spe")),
                 c_gen=_fmt(m.personal.get("c_gen")), seconds=f"{m.duration_s:.1f}")  # fmt: skip


def _fmt(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-"


def monitor(
    settings: BrokerSettings,
    federation: str,
    *,
    once: bool = False,
    timeout_s: float = 3.0,
    console: Console | None = None,
) -> int:
    """Exit 0 after a snapshot (``once``) or Ctrl-C; 1 when the broker cannot be used or, with ``once``, when the
    federation shows nothing (the message names the federations the broker does carry)."""
    console = console or Console(width=None if sys.stdout.isatty() else PIPE_WIDTH)  # a pipe: no 80-column cut
    view = FederationView(Topics(federation))
    client = _started(settings, view, timeout_s)
    where = f"{client.at.host}:{client.at.port}"
    if not client.connected.is_set():
        _say(f"cannot reach the broker at {where}: {client.problem or f'no answer within {timeout_s:g} s'}")
        client.stop(STOP_WAIT_S)
        return 1
    try:
        if once:
            _collect(client, view, timeout_s)
            if view.empty:
                _say(_nothing_seen(client, view, where, timeout_s))
                return 1
            console.print(view.render())
            return 0
        if console.is_terminal:
            with Live(view.render(), console=console, refresh_per_second=2) as live:
                return _watch(client, view, where, timeout_s, _refresher(live, view))
        return _watch(client, view, where, timeout_s, _print_line)  # a pipe or the journal: plain lines
    except KeyboardInterrupt:
        return 0
    finally:
        client.stop(STOP_WAIT_S)  # never wait for ever on paho's thread (it may sit in a full queue)


def _started(settings: BrokerSettings, view: FederationView, timeout_s: float) -> MqttClient:
    """A client on the view's topics, started: MQTT 5 as asked (it names a takeover), or 3.1.1 where the broker
    refuses 5 (NATS 2.9, deploy/nats/); ``connected`` is not set if no node answered within ``timeout_s``."""
    client = MqttClient(f"monitor-{uuid.uuid4().hex[:8]}", settings, persistent=False)
    for pattern in (view.topics.server_status, view.topics.server_metrics, view.topics.agent_status_wildcard):
        client.subscribe(pattern, qos=0)
    client.start(timeout_s=timeout_s)
    if client.protocol_refused and settings.protocol != "3.1.1":
        client.stop(STOP_WAIT_S)
        return _started(replace(settings, protocol="3.1.1"), view, timeout_s)
    return client


def _refresher(live: Live, view: FederationView) -> Callable[[str | None], None]:
    """Redraw at most twice a second: a burst of thousands of retained statuses is folded in, not drawn each."""
    drawn = [0.0]

    def refresh(_line: str | None) -> None:
        if (now := time.monotonic()) - drawn[0] >= 0.5:
            drawn[0] = now
            live.update(view.render())

    return refresh


def _print_line(line: str | None) -> None:
    if line is not None:
        print(line, flush=True)


def _say(text: str) -> None:
    print(f"skyfed monitor: {text}", file=sys.stderr, flush=True)


def _collect(client: MqttClient, view: FederationView, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not client.taken_over:
        if (msg := client.poll(left)) is not None:
            view.apply(*msg)


def _watch(
    client: MqttClient, view: FederationView, where: str, timeout_s: float, show: Callable[[str | None], None]
) -> int:
    """Until Ctrl-C: each message shown (``show(None)``: nothing new, refresh); after ``timeout_s`` of silence
    from the federation, say what the broker carries instead; stop (exit 1) when another client took the
    connection, rather than take it back for ever."""
    quiet_until = time.monotonic() + timeout_s
    while not client.taken_over:
        msg = client.poll(0.5)
        show(view.apply(*msg) if msg is not None else None)
        if view.empty and not view.hint and time.monotonic() > quiet_until:
            view.hint = _nothing_seen(client, view, where, timeout_s)
            show(f"note: {view.hint}")
    _say(f"{client.problem}; {TAKEN_OVER_FIX}" if client.taken_over else client.problem or "the broker closed the "
         "connection")  # fmt: skip
    return 1


def _nothing_seen(client: MqttClient, view: FederationView, where: str, waited_s: float) -> str:
    """What to tell an operator whose federation is silent: the federations whose server status this broker
    holds (asked briefly, then unsubscribed from by ending the client)."""
    client.subscribe(ANY_SERVER_STATUS, qos=0)
    seen: set[str] = set()
    deadline = time.monotonic() + DISCOVERY_S
    while (left := deadline - time.monotonic()) > 0:
        if (msg := client.poll(left)) is not None:
            topic, payload = msg
            parts = topic.split("/")
            if len(parts) == 4 and parts[2:] == ["server", "status"] and payload:
                seen.add(printable(parts[1], 64))
            view.apply(topic, payload)
    said = f"no status from federation {view.topics.federation!r} on {where} within {waited_s:g} s"
    others = sorted(seen - {view.topics.federation})
    if others:
        return f"{said}; federations with a server status there: {', '.join(others)} (pass --federation NAME)"
    return f"{said}, nor from any other federation this client may read: is the server running, and --broker right?"
