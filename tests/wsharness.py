"""Shared by the tests of mosquitto's WebSockets listener: the lab listener as docs/dashboard.md prints it, where
a port is bound (``/proc/net/tcp*``, what ``ss -ltn`` reads), this machine's own addresses (``ip -o addr``), and
an MQTT-over-WebSockets connection probe. Probes only ever reach this machine's own addresses."""

from __future__ import annotations

import ipaddress
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import paho.mqtt.client as paho

from protocol.mqtt import TlsSettings
from tests.fedharness import wait_until

DOC = Path(__file__).resolve().parent.parent / "docs" / "dashboard.md"
LAB_PORT = 9001  # the port docs/dashboard.md's lab listener names


def documented_lab_listener(port: int) -> str:
    """docs/dashboard.md's lab WebSockets listener (the indented block naming ``listener 9001``), on ``port``."""
    block = re.search(rf"\n((?: {{4}}listener {LAB_PORT}\b.*\n)(?: {{4}}\S.*\n)*)", DOC.read_text())
    assert block, f"no indented 'listener {LAB_PORT}' block in {DOC}"
    lines = [line.strip() for line in block.group(1).splitlines()]
    return "\n".join(lines).replace(f"listener {LAB_PORT}", f"listener {port}", 1) + "\n"


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port`` ('0.0.0.0' or '::': every address)."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, raw))
    return found


def wait_listening(port: int) -> set[str]:
    """``listening_addresses`` once there are any: mosquitto opens its WebSockets listener after its first one."""
    return wait_until(lambda: listening_addresses(port), timeout_s=10, what=f"a listener on port {port}")


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def machine_addresses() -> list[str]:
    """This machine's own non-loopback, non-link-local addresses (none where ``ip`` is missing)."""
    if shutil.which("ip") is None:
        return []
    out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True, timeout=10).stdout
    addresses = [ipaddress.ip_interface(line.split()[3]).ip for line in out.splitlines() if " inet" in line]
    return [str(a) for a in addresses if not (a.is_loopback or a.is_link_local)]


def tcp_open(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
    except OSError:
        return False
    return True


def ws_connects(address: str, port: int, tls: TlsSettings | None = None, *, client_cert: bool = True) -> bool:
    """Whether an MQTT-over-WebSockets client gets a CONNACK accepting it: anonymous without ``tls``, with
    ``tls`` over TLS (the server certificate checked against its CA, not its name), its certificate only
    with ``client_cert``."""
    accepted = threading.Event()
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="ws-probe", transport="websockets")
    client.on_connect = lambda _c, _u, _f, code, _p: code.is_failure or accepted.set()
    if tls is not None:
        client.tls_set(ca_certs=tls.ca_certs, certfile=tls.certfile if client_cert else None,
                       keyfile=tls.keyfile if client_cert else None)  # fmt: skip
        client.tls_insecure_set(True)  # the broker certificate names 127.0.0.1 and localhost, not every address
    try:
        client.connect(address, port, keepalive=10)
        client.loop_start()
        return accepted.wait(3)
    except OSError:
        return False
    finally:
        client.loop_stop()
        client.disconnect()
