"""``skyfed monitor``: a live terminal view of one federation, built only from its status topics.

It reads exactly what any operator could read with ``mosquitto_sub -v -t 'skyfed/<fed>/#'`` (retained
server, agent and peer status, per-round metrics) and needs no keys: status is public by design, and shown
as claimed (``broker_server.watch.monitor_view``).
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from rich.console import Console
from rich.live import Live

from broker_server.watch.monitor_tables import render
from broker_server.watch.monitor_view import FederationView
from common.text import printable
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import ROOT, Topics

ANY_SERVER_STATUS = f"{ROOT}/+/server/status"  # which federations a broker carries, asked when ours shows nothing
ANY_PEER_MEMBER = f"{ROOT}/+/peer/+/member"  # and which peer federations (they have no server)
DISCOVERY_S = 1.5  # retained status arrives at once; this is ample
STOP_WAIT_S = 1.0  # paho's thread may be mid-reconnect: the monitor exits without it
# the broker names a TLS client by its certificate: every watcher needs its own (docs/monitoring.md)
TAKEN_OVER_FIX = ("this monitor stops rather than take the connection back: run one skyfed monitor per certificate, "
                  "and mosquitto_sub with DIR/monitor/monitor-sub.crt (skyfed provision writes it)")  # fmt: skip
PIPE_WIDTH = 200  # columns of a --once snapshot into a file or pipe (rich would cut it at 80)


def monitor(
    settings: BrokerSettings,
    federation: str,
    *,
    once: bool = False,
    timeout_s: float = 3.0,
    console: Console | None = None,
) -> int:
    """Exit 0 after a snapshot (``once``) or Ctrl-C; 1 when the broker cannot be used, or when the federation
    has nothing on the broker after ``timeout_s`` (live too: a typo ends, the message names the federations the
    broker does carry). A federation with anything retained (a server's ``offline``, an agent's status, a
    peer's membership) is watched until its server starts."""
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
            if view.empty and _gone(client, view, where, timeout_s):
                return 1
            console.print(render(view))
            return 0
        if console.is_terminal:
            with Live(render(view), console=console, refresh_per_second=2) as live:
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
    for pattern in view.subscriptions:
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
            live.update(render(view))

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
    """Until Ctrl-C: each message shown (``show(None)``: nothing new, refresh); exit 1 when the federation still
    has nothing on the broker after ``timeout_s``, or when another client took the connection, rather than take
    it back for ever."""
    quiet_until = time.monotonic() + timeout_s
    while not client.taken_over:
        msg = client.poll(0.5)
        show(view.apply(*msg) if msg is not None else None)
        # judged only while connected: a connection being taken over is said as such, not as an empty federation
        if view.empty and client.problem is None and time.monotonic() > quiet_until and _gone(client, view, where,
                                                                                              timeout_s):
            return 1
    _say(f"{client.problem}; {TAKEN_OVER_FIX}" if client.taken_over else client.problem or "the broker closed the "
         "connection")  # fmt: skip
    return 1


def _gone(client: MqttClient, view: FederationView, where: str, waited_s: float) -> bool:
    """True, said with the federations this broker does carry, when ours has nothing on it: not a retained
    status of its server (``offline`` included), an agent or a peer. Asked briefly; anything of ours arriving
    meanwhile keeps the monitor watching."""
    for pattern in (ANY_SERVER_STATUS, ANY_PEER_MEMBER):
        client.subscribe(pattern, qos=0)
    seen: dict[str, set[str]] = {"server": set(), "peer": set()}
    deadline = time.monotonic() + DISCOVERY_S
    while (left := deadline - time.monotonic()) > 0:
        if (msg := client.poll(left)) is not None:
            if (found := _federation_of(*msg)) is not None:
                seen[found[0]].add(printable(found[1], 64))
            view.apply(*msg)
    if not view.empty:
        return False
    said = f"no status from federation {view.topics.federation!r} on {where} within {waited_s:g} s"
    servers, peers = (sorted(seen[kind] - {view.topics.federation}) for kind in ("server", "peer"))
    found = [f"federations with a server status there: {', '.join(servers)}"] if servers else []
    found += [f"peer federations there: {', '.join(peers)}"] if peers else []
    if found:
        _say(f"{said}; {'; '.join(found)} (pass --federation NAME)")
    else:
        _say(f"{said}, nor from any other federation this client may read: is the server running, and --broker "
             "right?")  # fmt: skip
    return True


def _federation_of(topic: str, payload: bytes) -> tuple[str, str] | None:
    """``("server", F)`` for F's retained server status, ``("peer", F)`` for a peer's membership in F."""
    parts = topic.split("/")
    if not payload or parts[0] != ROOT:
        return None
    if len(parts) == 4 and parts[2:] == ["server", "status"]:
        return "server", parts[1]
    if len(parts) == 5 and parts[2] == "peer" and parts[4] == "member":
        return "peer", parts[1]
    return None
