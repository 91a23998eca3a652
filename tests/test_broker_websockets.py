"""mosquitto's WebSockets listener as docs/dashboard.md prints it for a lab broker: loopback only, checked on this
machine's own addresses. mosquitto 2.0 binds a WebSockets listener on every address whatever IPv4 address it
names, so the documented listener names the interface (``lo``). The provisioned listener, which requires a
client certificate, is checked in tests/test_provision_dashboard.py."""

from __future__ import annotations

import pytest

from sim.broker import free_port, start_broker
from tests.wsharness import (
    documented_lab_listener,
    is_loopback,
    machine_addresses,
    tcp_open,
    wait_listening,
    ws_connects,
)

pytestmark = pytest.mark.integration


def test_the_documented_lab_listener_is_bound_to_loopback_only(tmp_path):
    ws_port = free_port()
    broker = start_broker(data_dir=tmp_path / "broker", kind="mosquitto", extra_config=documented_lab_listener(ws_port))
    try:
        bound = wait_listening(ws_port)
        print(f"WebSockets listener {ws_port} bound on {sorted(bound)}; this machine: {machine_addresses()}")
        assert bound and all(is_loopback(address) for address in bound), f"bound on {bound}, not loopback only"
        assert ws_connects("127.0.0.1", ws_port), "anonymous over loopback: what a lab broker is for"
        for address in machine_addresses():
            assert not tcp_open(address, ws_port), f"the lab listener is reachable on {address}"
    finally:
        broker.stop()
