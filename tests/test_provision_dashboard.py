"""``skyfed provision --ws-port``: mosquitto's MQTT-over-WebSockets listener for the dashboard, with mutual TLS and
the monitor's read-only ACL, run from the generated files by a real mosquitto."""

from __future__ import annotations

import time
from pathlib import Path

from cryptography.hazmat.primitives.serialization import pkcs12

from sim.broker import free_port, start_broker
from skyfed import main
from tests.fedharness import wait_until
from tests.tlsharness import Client, node_tls
from tests.wsharness import is_loopback, machine_addresses, wait_listening, ws_connects

FED = "fleet"


def provision(out: Path, port: int, *extra: str) -> int:
    return main(["provision", "--federation", FED, "--agents", "a1", "--out", str(out), "--broker",
                 f"127.0.0.1:{port}", "--listen", "127.0.0.1", *extra])  # fmt: skip


def test_the_dashboard_reads_status_metrics_and_history_over_websockets_and_nothing_else(workdir, capsys):
    out, port, ws_port = workdir / "fed", free_port(), free_port()
    assert provision(out, port) == 0
    assert "protocol websockets" not in (out / "broker" / "skyfed.conf").read_text()
    assert provision(out, port, "--ws-port", str(ws_port)) == 0, "added to a folder provisioned before"
    assert f"--ws-port {ws_port} --tls --federation {FED}" in capsys.readouterr().out
    conf = (out / "broker" / "skyfed.conf").read_text()
    assert f"listener {ws_port} lo\nprotocol websockets\n" in conf, "loopback: an interface name mosquitto honours"
    password = (out / "dashboard" / "dashboard.p12.password").read_text().strip().encode()
    key, cert, cas = pkcs12.load_key_and_certificates((out / "dashboard" / "dashboard.p12").read_bytes(), password)
    assert key is not None and "CN=dashboard" in cert.subject.rfc4514_string() and len(cas) == 1
    broker = start_broker(data_dir=workdir / "broker-run", kind="mosquitto", port=port,
                          config_file=out / "broker" / "skyfed.conf")  # fmt: skip
    root = f"skyfed/{FED}"
    try:
        assert all(is_loopback(address) for address in wait_listening(ws_port)), "--listen 127.0.0.1: loopback only"
        server = Client(out / "server", "server", port, f"{root}/server/status")
        for topic, payload in ((f"{root}/server/status", b"status"), (f"{root}/server/history", b"history"),
                               (f"{root}/model/1/0", b"model chunk"), (f"{root}/agent/a1/inbox", b"inbox")):
            server.publish(topic, payload, retain=True)
        dash = Client(out / "dashboard", "dashboard", ws_port, f"{root}/server/+", f"{root}/model/#",
                      f"{root}/agent/a1/inbox", transport="websockets")  # fmt: skip
        wait_until(lambda: len(dash.received) >= 2, 5, "retained status and history over WebSockets")
        dash.publish(f"{root}/server/status", b"forged by the dashboard", retain=True)
        time.sleep(0.5)
        assert sorted(dash.received) == [(f"{root}/server/history", b"history"), (f"{root}/server/status", b"status")]
        assert b"forged by the dashboard" not in [p for _, p in server.received], "read only"
        dash.close()
        server.close()
    finally:
        broker.stop()
        print(f"--- broker log ---\n{broker.log_tail(40)}")


def test_a_peer_federations_dashboard_reads_each_peers_member_metrics_and_best_and_nothing_else(workdir, capsys):
    out, port, ws_port = workdir / "p", free_port(), free_port()
    argv = ["provision", "--mode", "peer", "--federation", FED, "--agents", "p1,p2", "--out", str(out), "--broker",
            f"127.0.0.1:{port}", "--listen", "127.0.0.1", "--state-dir", str(workdir / "state"), "--any-state-dir",
            "--ws-port", str(ws_port)]  # fmt: skip
    assert main(argv) == 0  # on main: refused, so a peer federation had no dashboard
    assert f"--ws-port {ws_port} --tls --federation {FED}" in capsys.readouterr().out
    broker = start_broker(data_dir=workdir / "broker-run", kind="mosquitto", port=port,
                          config_file=out / "broker" / "skyfed.conf")  # fmt: skip
    peers = f"skyfed/{FED}/peer"
    try:
        p1 = Client(out / "peers" / "p1", "p1", port)
        for leaf in ("member", "metrics", "best", "to/p2"):
            p1.publish(f"{peers}/p1/{leaf}", leaf.encode(), retain=True)
        dash = Client(out / "dashboard", "dashboard", ws_port, *(f"{peers}/+/{leaf}" for leaf in
                      ("member", "metrics", "best", "to/p2")), transport="websockets")  # fmt: skip
        wait_until(lambda: len(dash.received) >= 3, 5, "each peer's retained member, metrics and best over WebSockets")
        dash.publish(f"{peers}/p1/best", b"forged by the dashboard", retain=True)
        time.sleep(0.5)
        assert sorted(p for _, p in dash.received) == [b"best", b"member", b"metrics"], "read only, no sealed model"
        dash.close()
        p1.close()
    finally:
        broker.stop()
        print(f"--- broker log ---\n{broker.log_tail(40)}")


def test_the_websockets_listener_on_every_address_lets_no_one_in_without_a_certificate(workdir):
    """Provisioned without --listen, as for a fleet's network: mosquitto binds the WebSockets listener on every
    address, and on each of this machine's own the dashboard certificate gets in while no one without it does."""
    out, port, ws_port = workdir / "fed", free_port(), free_port()
    assert main(["provision", "--federation", FED, "--agents", "a1", "--out", str(out), "--broker",
                 f"127.0.0.1:{port}", "--ws-port", str(ws_port)]) == 0  # fmt: skip
    broker = start_broker(data_dir=workdir / "broker-run", kind="mosquitto", port=port,
                          config_file=out / "broker" / "skyfed.conf")  # fmt: skip
    dashboard = node_tls(out / "dashboard", "dashboard")
    try:
        print(f"WebSockets listener {ws_port} bound on {sorted(wait_listening(ws_port))}")
        for address in ["127.0.0.1", *machine_addresses()]:
            assert ws_connects(address, ws_port, dashboard), f"the dashboard certificate over {address}"
            assert not ws_connects(address, ws_port), f"anonymous without TLS over {address}"
            assert not ws_connects(address, ws_port, dashboard, client_cert=False), f"no certificate over {address}"
    finally:
        broker.stop()
        print(f"--- broker log ---\n{broker.log_tail(40)}")
