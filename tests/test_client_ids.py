"""One connection per certificate (mosquitto's ``use_username_as_clientid``): the provisioned watchers do not
evict each other, and a daemon knocked off by a client on its certificate says so, on a real TLS broker."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time

import pytest

from protocol import mqtt
from protocol.mqtt import BrokerSettings, MqttClient, TlsSettings
from tests.fedharness import wait_until
from tests.liveharness import cli_popen

pytestmark = pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="needs mosquitto_sub")


def _sub(folder, name: str, port: int, *args: str) -> subprocess.Popen:  # noqa: ANN001
    """mosquitto_sub as the printed instructions run it, with ``folder``'s certificate ``name``."""
    tls = ["--cafile", str(folder / "ca.crt"), "--cert", str(folder / f"{name}.crt"),
           "--key", str(folder / f"{name}.crt.key")]  # fmt: skip
    return subprocess.Popen(["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), *tls, "-v", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_the_printed_monitor_and_mosquitto_sub_lines_run_together(provisioned, capsys):  # noqa: F811
    out, _, _, port = provisioned
    mon = out / "monitor"
    printed = (out / "README.txt").read_text()
    assert "monitor-sub.crt" in printed and "a second watcher with the same one evicts the first" in printed
    tls = ["--cafile", str(mon / "ca.crt"), "--cert", str(mon / "monitor.crt"), "--key", str(mon / "monitor.crt.key")]
    # no server runs here: a long --timeout keeps the live monitor from exiting on an empty federation
    watcher = cli_popen("monitor", "--broker", f"127.0.0.1:{port}", "--federation", "fleet", "--timeout", "120", *tls)
    try:
        time.sleep(2.0)
        sub = _sub(mon, "monitor-sub", port, "-t", "skyfed/fleet/agent/+/status", "-W", "4")
        _, sub_err = sub.communicate(timeout=20)  # -W: exits after 4 s; evicted, it would reconnect and evict back
        assert watcher.poll() is None, watcher.communicate()[1]  # the monitor was not evicted
        assert "not authori" not in sub_err.lower() and "error" not in sub_err.lower(), sub_err
    finally:
        watcher.kill()
        _, err = watcher.communicate()
    assert "another client" not in err, err


def test_a_server_evicted_by_a_client_on_its_certificate_names_the_cause(provisioned, caplog, monkeypatch):  # noqa: F811
    out, _, _, port = provisioned
    server = out / "server"
    tls = TlsSettings(str(server / "ca.crt"), str(server / "server.crt"), str(server / "server.crt.key"))
    monkeypatch.setattr(mqtt, "EVICTION_WINDOW_S", 0.5)  # the drop comes long after connecting, as in the field
    client = MqttClient("fleet-server", BrokerSettings("127.0.0.1", port, tls=tls))  # MQTT 3.1.1: no reason sent
    caplog.set_level(logging.INFO, logger="skyfed.mqtt")
    assert client.start(timeout_s=10)
    time.sleep(1.0)
    other = _sub(server, "server", port, "-t", "skyfed/fleet/round", "-W", "3")
    try:
        said = lambda: [r.getMessage() for r in caplog.records if "mqtt disconnected" in r.getMessage()]  # noqa: E731
        wait_until(said, 10, "the server's disconnect line")
    finally:
        other.kill()
        other.wait()
        client.stop(2)
    line = said()[0]
    assert "reason=the broker closed the connection without a reason: another client connected with this client " \
           f"id 'server' (the same certificate? {server / 'server.crt'})" in line, line
    assert "Unspecified error" not in line
