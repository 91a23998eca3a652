"""Start and stop a real local MQTT broker for the sim, the demo, benchmarks and tests.

Debian's ``mosquitto`` when it is installed (persistence on, so a restart keeps retained messages
and persistent sessions, as a production broker would), otherwise the pip-installed ``iotcore``
broker (rumqttd in a wheel; no persistence across restarts). Loopback only, on a free port unless
one is given. Never the pure-Python amqtt: it mishandles retained messages and persistent sessions
(shared/references/ecosystem_feasibility.md, addendum).
"""

from __future__ import annotations

import getpass
import logging
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("skyfed.sim.broker")

EMBEDDED_MAX_PAYLOAD = 64 << 20  # iotcore's default (20 KiB) silently drops model chunks


LISTEN_PORTS_FROM = 20000  # below the ephemeral range; above most well-known daemons' ports
_GIVEN: set[int] = set()  # ports free_port handed out in this process


def ephemeral_ports_from(table: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The kernel's lowest port for outgoing connections (Linux's default, 32768, where it cannot be read)."""
    try:
        return int(table.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, drawn below the ephemeral range (where that starts above 21000, as Linux's
    default 32768 does; below that, from 20000-20999 all the same).

    A port the kernel hands out for binding to 0 is also one it hands out as the source of outgoing
    connections: while a broker is down for a restart, any client's connect (even an agent's retry to
    that very port, a TCP self-connect) can take it, and the broker cannot listen there again. A port this
    process was given before is never given again: callers draw several before any of them listens (a cluster).
    """
    top = max(ephemeral_ports_from(), LISTEN_PORTS_FROM + 1000)
    for _ in range(200):
        port = LISTEN_PORTS_FROM + secrets.randbelow(top - LISTEN_PORTS_FROM)
        if port in _GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in {LISTEN_PORTS_FROM}-{top - 1}")


def installed(program: str) -> str | None:
    """Where a broker program is: on PATH, or in /usr/sbin (Debian's packages put daemons there)."""
    found = shutil.which(program)
    if found:
        return found
    return f"/usr/sbin/{program}" if Path(f"/usr/sbin/{program}").exists() else None


def mosquitto_path() -> str | None:
    return installed("mosquitto")


@dataclass(frozen=True)
class ListenerTls:
    """Mutual TLS on the listener: clients must present a certificate signed by ``ca``."""

    ca: Path
    cert: Path
    key: Path
    acl_file: Path | None = None


def mosquitto_config(host: str, port: int, data_dir: Path, tls: ListenerTls | None = None, extra: str = "") -> str:
    """A loopback broker's config; ``extra``: lines appended as they are (a bridge, ``provisioning.bridge``)."""
    tls_lines = (
        [
            f"cafile {tls.ca}",
            f"certfile {tls.cert}",
            f"keyfile {tls.key}",
            "require_certificate true",
            "use_identity_as_username true",
            *([f"acl_file {tls.acl_file}"] if tls.acl_file is not None else []),
        ]
        if tls is not None
        else []
    )
    return "\n".join(
        [
            f"listener {port} {host}",
            *tls_lines,
            "allow_anonymous true",  # a local sim/test broker; deployments get TLS + ACL configs
            f"user {getpass.getuser()}",
            "persistence true",
            f"persistence_location {data_dir}/",
            "autosave_interval 1",
            "max_queued_messages 100000",
            "max_queued_bytes 0",
            "message_size_limit 0",
            f"log_dest file {data_dir / 'mosquitto.log'}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "",
        ]
    ) + extra


def accepts(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` now."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class LocalBroker:
    """A broker child process on ``host:port``; ``restart`` keeps the port (and, for mosquitto, its state)."""

    kind: str
    host: str
    port: int
    data_dir: Path
    startup_timeout_s: float = 10.0
    tls: ListenerTls | None = None
    config_file: Path | None = None  # a config written elsewhere (skyfed provision's); its stderr is the log
    extra_config: str = ""  # appended to the generated config: a bridge (``provisioning.bridge``)
    _process: subprocess.Popen | None = field(default=None, repr=False)
    _embedded: object | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> LocalBroker:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        if self.kind == "mosquitto":
            conf = self.config_file or self.data_dir / "mosquitto.conf"
            if self.config_file is None:
                conf.write_text(mosquitto_config(self.host, self.port, self.data_dir, self.tls, self.extra_config))
            with open(self.data_dir / "mosquitto.log", "ab") as stderr:
                self._process = subprocess.Popen(
                    [mosquitto_path() or "mosquitto", "-c", str(conf)],
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    start_new_session=True,
                )
        else:
            from iotcore import Broker

            self._embedded = Broker(port=self.port, listen=self.host, max_payload_size=EMBEDDED_MAX_PAYLOAD)
            self._embedded.start(timeout=self.startup_timeout_s)  # type: ignore[attr-defined]
        while not accepts(self.host, self.port):
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with code {self._process.returncode}:\n{self.log_tail()}")
            if time.monotonic() - started > self.startup_timeout_s:
                self.kill()
                raise RuntimeError(f"{self.kind} did not accept connections on {self.address}:\n{self.log_tail()}")
            time.sleep(0.02)
        log.info("broker started kind=%s address=%s seconds=%.2f", self.kind, self.address, time.monotonic() - started)
        return self

    def stop(self) -> None:
        """SIGTERM (mosquitto saves its persistence file), then SIGKILL if it does not exit."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        self._end(signal.SIGKILL)

    def reload(self) -> None:
        """SIGHUP: mosquitto re-reads its ACL and CRL (what ``systemctl reload mosquitto`` does)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGHUP)

    def restart(self) -> None:
        self.stop()
        self.start()

    def _end(self, signum: int) -> None:
        if self._embedded is not None:
            self._embedded.stop()  # type: ignore[attr-defined]
            self._embedded = None
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signum)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.info("broker stopped kind=%s address=%s", self.kind, self.address)

    def log_tail(self, lines: int = 20) -> str:
        path = self.data_dir / "mosquitto.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else "(no broker log)"

    def __enter__(self) -> LocalBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_broker(
    *,
    data_dir: Path,
    kind: str = "auto",
    host: str = "127.0.0.1",
    port: int | None = None,
    startup_timeout_s: float = 10.0,
    tls: ListenerTls | None = None,
    config_file: Path | None = None,
    extra_config: str = "",
) -> LocalBroker:
    """Start mosquitto (or, with ``kind="auto"`` and no mosquitto installed, iotcore) and wait until it listens."""
    if kind == "auto":
        kind = "mosquitto" if mosquitto_path() else "iotcore"
    if kind == "iotcore":
        try:
            import iotcore  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "no MQTT broker available: install Debian's mosquitto (apt-get install mosquitto) "
                "or the embedded one (pip install iotcore)"
            ) from None
    elif kind != "mosquitto":
        raise ValueError(f"broker kind must be auto, mosquitto or iotcore, got {kind!r}")
    if tls is not None and kind != "mosquitto":
        raise ValueError("a TLS listener needs mosquitto")
    if config_file is not None and (kind != "mosquitto" or port is None):
        raise ValueError("a config file needs kind='mosquitto' and the port it names")
    if extra_config and kind != "mosquitto":
        raise ValueError("a bridge needs mosquitto")
    broker = LocalBroker(kind, host, port or free_port(host), data_dir, startup_timeout_s, tls, config_file,
                         extra_config)  # fmt: skip
    return broker.start()
