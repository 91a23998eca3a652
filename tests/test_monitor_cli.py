"""``skyfed monitor`` as an operator runs it: against a real broker, wrong names, pipes, TLS and hostile status."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path

import pytest
from rich.console import Console

from broker_server.watch.monitor import monitor
from broker_server.watch.monitor_tables import render
from broker_server.watch.monitor_view import FederationView
from common.logs import JournalFormatter
from common.text import PrintableFormatter, printable
from protocol.messages import AgentStatus
from protocol.mqtt import BrokerSettings, TlsSettings
from protocol.peer_messages import PeerMember, PeerRoundMetrics
from protocol.topics import Topics
from security.keys import Identity
from security.pki import create_ca, issue
from security.signing import signed_payload
from sim.broker import ListenerTls, free_port, start_broker
from tests.liveharness import cli_popen, mqtt_publisher, retain_all, status_payload

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = "\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\x1b[8mhidden\x1b[0m\u202eevil\x9b31m\x7f"


def test_printable_escapes_every_control_and_bidi_character():
    shown = printable(HOSTILE, 1000)
    assert shown.isprintable() and "\x1b" not in shown and "\u202e" not in shown and "\x9b" not in shown
    assert "\\x1b]52" in shown and "\\u202e" in shown and "\\x9b" in shown
    assert all(printable(chr(c)) != chr(c) for c in [*range(0x20), *range(0x7F, 0xA0), 0x2066, 0x200F])


def test_escape_sequences_in_status_never_reach_the_terminal():
    view = FederationView(Topics("fleet"))
    status = AgentStatus(agent="drone-01", state=HOSTILE, round=1, samples=1, version=1, updated_at=0.0,
                         detail=HOSTILE)  # fmt: skip
    line = view.apply("skyfed/fleet/agent/drone-01/status", signed_payload(status.to_dict(), Identity.generate("d")))
    assert line is not None and line.isprintable() and "\\x1b]52" in line
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=300).print(render(view))
    for sequence in ("\x1b]52", "\x1b[2J", "\x1b[8m", "\u202e", "\x9b", "\x07"):
        assert sequence not in out.getvalue()
    assert "\\x1b[2J" in out.getvalue()


def test_log_lines_stay_one_printable_line():
    forged = ("a\nINFO forged" + HOSTILE,)
    record = logging.LogRecord("skyfed.t", logging.WARNING, __file__, 1, "status agent=%s", forged, None)
    for formatter in (PrintableFormatter("%(levelname)s %(message)s"), JournalFormatter("%(message)s")):
        line = formatter.format(record)
        assert "forged" in line and line.isprintable() and "\\x1b]52" in line


def test_once_with_thousands_of_retained_statuses_returns(broker):
    publisher = mqtt_publisher(broker)
    identity = Identity.generate("drone")
    for i in range(3000):
        status = AgentStatus(agent=f"d{i}", state="ready", round=0, samples=1, version=1, updated_at=time.time())
        publisher.publish(f"skyfed/fleet/agent/d{i}/status", signed_payload(status.to_dict(), identity), retain=True)
    publisher.publish("skyfed/fleet/server/status", status_payload("fleet"), qos=1, retain=True).wait_for_publish(10)
    started = time.monotonic()
    proc = cli_popen("monitor", "--once", "--broker", f"{broker.host}:{broker.port}", "--federation", "fleet",
                   "--timeout", "0.3")  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)  # on main it never returned: paho's thread blocked in a full queue
    finally:
        proc.kill()
        publisher.loop_stop()
    assert proc.returncode == 0, err
    assert time.monotonic() - started < 30 and "fleet" in out


def test_a_wrong_federation_names_the_federations_the_broker_carries(broker, capsys):
    publisher = mqtt_publisher(broker)
    for fed in ("fleet", "lab"):
        publisher.publish(f"skyfed/{fed}/server/status", status_payload(fed), qos=1, retain=True).wait_for_publish(5)
    publisher.loop_stop()
    settings = BrokerSettings(broker.host, broker.port, protocol="5")
    assert monitor(settings, "demo", once=True, timeout_s=0.5) == 1
    err = capsys.readouterr().err
    assert "no status from federation 'demo'" in err and "fleet, lab" in err and "--federation" in err
    assert monitor(settings, "fleet", once=True, timeout_s=0.5, console=Console(file=io.StringIO())) == 0


def test_the_live_monitor_prints_plain_lines_into_a_pipe(broker):
    publisher = mqtt_publisher(broker)
    publisher.publish("skyfed/fleet/server/status", status_payload("fleet"), qos=1, retain=True).wait_for_publish(5)
    publisher.loop_stop()
    proc = cli_popen("monitor", "--broker", f"{broker.host}:{broker.port}", "--federation", "fleet")
    try:
        line = proc.stdout.readline()  # on main: nothing at all without a terminal
    finally:
        proc.kill()
        proc.wait()
    assert line.startswith("server federation=fleet state=running round=3"), line


@pytest.fixture
def mismatched_broker(tmp_path):
    """A TLS broker whose certificate names another host, and the CA that signed it."""
    ca = create_ca(tmp_path / "pki", "tls")
    cert = issue(ca, tmp_path / "pki", "broker", hosts=("broker.elsewhere",))
    broker = start_broker(data_dir=tmp_path / "broker", kind="mosquitto", tls=ListenerTls(ca.cert, cert.cert, cert.key))
    yield broker, ca
    broker.stop()


def test_connection_failures_name_their_cause(mismatched_broker, tmp_path, capsys):
    broker, ca = mismatched_broker
    other = create_ca(tmp_path / "other", "other")
    cases = [
        (BrokerSettings(broker.host, broker.port, tls=TlsSettings(str(ca.cert))), "mismatch, certificate is not valid"),
        (BrokerSettings(broker.host, broker.port, tls=TlsSettings(str(other.cert))), "self-signed certificate"),
        (BrokerSettings("127.0.0.1", free_port()), "nothing listens"),
    ]
    for settings, cause in cases:
        assert monitor(settings, "fleet", once=True, timeout_s=2) == 1
        err = capsys.readouterr().err
        assert "cannot reach the broker" in err and cause in err, err


def test_a_second_monitor_on_the_same_certificate_is_named_not_an_unspecified_error(provisioned):  # noqa: F811
    out, _, _, port = provisioned
    mon = out / "monitor"
    tls = ["--cafile", str(mon / "ca.crt"), "--cert", str(mon / "monitor.crt"), "--key", str(mon / "monitor.crt.key")]
    first = cli_popen("monitor", "--broker", f"127.0.0.1:{port}", "--federation", "fleet", "--timeout", "120", *tls)
    time.sleep(2.0)
    second = cli_popen("monitor", "--broker", f"127.0.0.1:{port}", "--federation", "fleet", "--timeout", "120", *tls)
    try:
        _, err = first.communicate(timeout=20)  # on main: both reconnect and evict each other for ever
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
    assert first.returncode == 1
    assert "another client connected with this client id 'monitor' (the same certificate?" in err, err
    assert "monitor.crt)" in err and "mosquitto_sub with DIR/monitor/monitor-sub.crt" in err, err


def _member(federation: str, peer: str) -> bytes:
    return signed_payload(PeerMember(federation, peer, "member", 3, 1.0, 1.0).to_dict(), Identity.generate(peer))


def test_the_live_monitor_exits_on_a_federation_the_broker_does_not_carry(broker):
    retain_all(broker, {"skyfed/fleet/server/status": status_payload("fleet"),
                        "skyfed/p2p/peer/p0/member": _member("p2p", "p0")})  # fmt: skip
    started = time.monotonic()
    proc = cli_popen("monitor", "--broker", f"{broker.host}:{broker.port}", "--federation", "flet", "--timeout", "1")
    try:
        out, err = proc.communicate(timeout=60)  # on main: it waited for ever, printing a note
    finally:
        proc.kill()
    assert proc.returncode == 1, (out, err)
    assert "no status from federation 'flet'" in err and "with a server status there: fleet" in err
    assert "peer federations there: p2p" in err and time.monotonic() - started < 30


def test_the_live_monitor_waits_for_a_server_not_started_when_its_agents_are_there(broker):
    status = AgentStatus(agent="d1", state="ready", round=0, samples=1, version=1, updated_at=time.time())
    retain_all(broker, {"skyfed/fleet/agent/d1/status": signed_payload(status.to_dict(), Identity.generate("d1"))})
    proc = cli_popen("monitor", "--broker", f"{broker.host}:{broker.port}", "--federation", "fleet", "--timeout", "0.5")
    try:
        first = proc.stdout.readline()
        time.sleep(0.5 + 1.5 + 1.0)  # past --timeout and the discovery it would make for an empty federation
        assert proc.poll() is None, proc.stderr.read()
        retain_all(broker, {"skyfed/fleet/server/status": status_payload("fleet")})
        second = proc.stdout.readline()
    finally:
        proc.kill()
        proc.wait()
    assert first.startswith("agent id=d1 state=ready"), first
    assert second.startswith("server federation=fleet state=running"), second


def test_once_shows_a_peer_federation(broker):
    peers = {f"skyfed/p2p/peer/{p}/member": _member("p2p", p) for p in ("p0", "p1")}
    metrics = PeerRoundMetrics("p1", 2, "aggregated", {"map50": 0.42}, ["p0", "p1"])
    peers["skyfed/p2p/peer/p1/metrics"] = signed_payload(metrics.to_dict(), Identity.generate("p1"))
    retain_all(broker, peers)
    out = io.StringIO()
    settings = BrokerSettings(broker.host, broker.port, protocol="5")
    assert monitor(settings, "p2p", once=True, timeout_s=0.5, console=Console(file=out, width=200)) == 0
    rows = [line for line in out.getvalue().splitlines() if line.startswith("│ p")]
    assert len(rows) == 2 and "mAP@.5" in out.getvalue() and "0.4200" in rows[1] and "│ 2 " in rows[1]


def test_a_replayed_offline_beside_the_servers_count_is_said_to_be_a_claim(broker):
    replayed = AgentStatus.offline("d1", session=time.time() - 3600)  # an earlier connection's will, published again
    will = signed_payload(replayed.to_dict(), Identity.generate("d1"))
    retain_all(broker, {"skyfed/fleet/server/status": status_payload("fleet"), "skyfed/fleet/agent/d1/status": will})
    out = io.StringIO()
    settings = BrokerSettings(broker.host, broker.port, protocol="5")
    assert monitor(settings, "fleet", once=True, timeout_s=0.5, console=Console(file=out, width=200)) == 0
    shown = out.getvalue()
    assert "as each claims" in shown and "the server counts 1 agents online; 0 statuses here claim to be" in shown
