"""Start and stop a local NATS cluster (Debian ``nats-server``) whose nodes speak MQTT, for the sim and tests.

Each node has an ``mqtt{}`` listener, JetStream (which holds MQTT sessions and retained messages, replicated
to every node) and routes to the others, all on free loopback ports. ``deploy/nats/`` holds the same
configuration for real hosts. nats-server 2.9 speaks MQTT 3.1.1 with QoS 0 and 1 only, and refuses
topics with ``.`` or spaces (docs in deploy/nats/README.md).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from protocol.mqtt import BrokerSettings, MqttClient, parse_address
from sim.broker import accepts, free_port, installed

log = logging.getLogger("skyfed.sim.nats")

NATS_MAX_PAYLOAD = 4 << 20  # SkyFed chunks are 1 MiB plus a header; NATS's default max_payload is 1 MB
CLUSTER_NAME = "skyfed"


def parse_cluster_spec(spec: str) -> int:
    """``--broker-cluster nats:N`` as N (3-9 nodes)."""
    kind, _, size = spec.partition(":")
    if kind != "nats" or not size.isdigit() or not 3 <= int(size) <= 9:
        raise ValueError(f"--broker-cluster {spec!r} must look like nats:N with N = 3-9 nodes, e.g. nats:3")
    return int(size)


def spread_broker_table(nodes: list[str], k: int) -> dict[str, object]:
    """The ``[broker]`` table of a federation's k-th node (0: the server): cluster node k mod n first and the
    others as ``fallbacks``, so the federation's connections spread over the cluster (one node: no fallbacks)."""
    order = [nodes[(k + i) % len(nodes)] for i in range(len(nodes))]
    host, port = parse_address(order[0])
    return {"host": host, "port": port, **({"fallbacks": order[1:]} if len(order) > 1 else {})}


def nats_server_path() -> str | None:
    return installed("nats-server")


@dataclass(frozen=True)
class NodePorts:
    """One node's listeners: NATS clients, cluster routes, MQTT, and HTTP monitoring (its ``/healthz``)."""

    client: int
    cluster: int
    mqtt: int
    http: int

    @classmethod
    def free(cls, host: str) -> NodePorts:
        return cls(free_port(host), free_port(host), free_port(host), free_port(host))


def nats_config(name: str, host: str, ports: NodePorts, routes: list[str], store_dir: Path) -> str:
    """One node's nats-server config: the ``deploy/nats/`` template with loopback ports and no TLS."""
    route_urls = ", ".join(f'"nats-route://{route}"' for route in routes)
    return "\n".join(
        [
            f'server_name: "{name}"',  # MQTT and JetStream clustering need a stable name per node
            f'host: "{host}"',
            f"port: {ports.client}",
            f'http: "{host}:{ports.http}"',
            f"max_payload: {NATS_MAX_PAYLOAD}",
            f'jetstream {{ store_dir: "{store_dir}" }}',
            f'cluster {{ name: "{CLUSTER_NAME}", listen: "{host}:{ports.cluster}", routes: [{route_urls}] }}',
            f'mqtt {{ listen: "{host}:{ports.mqtt}", stream_replicas: 3 }}',
            "",
        ]
    )


@dataclass
class NatsNode:
    """One nats-server child process; ``restart`` keeps its ports and JetStream store."""

    name: str
    host: str
    ports: NodePorts
    data_dir: Path
    _process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        """The MQTT listener, as ``HOST:PORT``."""
        return f"{self.host}:{self.ports.mqtt}"

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def spawn(self, config: str) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "nats.conf"
        conf.write_text(config)
        self._process = subprocess.Popen(
            [nats_server_path() or "nats-server", "-c", str(conf), "-l", str(self.log_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def healthy(self) -> bool:
        """Its MQTT listener accepts and ``/healthz`` says JetStream is up (a meta leader is elected)."""
        if not accepts(self.host, self.ports.mqtt):
            return False
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.ports.http}/healthz", timeout=1) as answer:
                return json.loads(answer.read()).get("status") == "ok"
        except (OSError, ValueError):
            return False

    def kill(self) -> None:
        """SIGKILL: a node lost with no goodbye (a crash, a power cut)."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def _end(self, signum: int) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signum)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.info("nats node stopped node=%s address=%s signal=%s", self.name, self.address, signum)

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats.log"

    def log_tail(self, lines: int = 20) -> str:
        path = self.log_path
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else "(no nats log)"


@dataclass
class NatsCluster:
    """A running cluster of ``NatsNode``; ``addresses`` are the MQTT listeners, the first one first."""

    nodes: list[NatsNode]
    kind: str = "nats"

    @property
    def addresses(self) -> list[str]:
        return [node.address for node in self.nodes]

    @property
    def address(self) -> str:
        """Every node, comma-separated (what ``--broker`` and ``BrokerSettings.from_address`` take)."""
        return ",".join(self.addresses)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def log_tail(self, lines: int = 10) -> str:
        return "\n".join(f"--- {node.name} ---\n{node.log_tail(lines)}" for node in self.nodes)

    def __enter__(self) -> NatsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_mqtt(node: NatsNode, timeout_s: float) -> None:
    """An MQTT 3.1.1 client is accepted on ``node`` (JetStream has a leader and the MQTT streams exist)."""
    probe = MqttClient(f"skyfed-probe-{node.name}", BrokerSettings(host=node.host, port=node.ports.mqtt),
                       persistent=False)  # fmt: skip
    try:
        if not probe.start(timeout_s=max(1.0, timeout_s)):
            raise RuntimeError(f"nats-server {node.name} refused MQTT ({probe.problem}):\n{node.log_tail()}")
    finally:
        probe.stop(1.0)


def start_nats_cluster(
    data_dir: Path, size: int = 3, *, host: str = "127.0.0.1", startup_timeout_s: float = 30.0
) -> NatsCluster:
    """Start ``size`` routed nodes and wait until every one is healthy (JetStream up on all of them)."""
    if nats_server_path() is None:
        raise RuntimeError("nats-server is not installed: apt-get install nats-server (Debian's, 2.9 or newer)")
    if not 3 <= size <= 9:
        raise ValueError(f"a NATS cluster needs 3-9 nodes (JetStream keeps a quorum after losing one), got {size}")
    ports = [NodePorts.free(host) for _ in range(size)]
    routes = [f"{host}:{p.cluster}" for p in ports]
    nodes = [NatsNode(f"nats-{i + 1}", host, p, data_dir / f"nats-{i + 1}") for i, p in enumerate(ports)]
    cluster = NatsCluster(nodes)
    started = time.monotonic()
    for node in nodes:
        node.spawn(nats_config(node.name, host, node.ports, routes, node.data_dir / "jetstream"))
    try:
        for node in nodes:
            while not node.healthy():
                if not node.alive:
                    raise RuntimeError(f"nats-server {node.name} exited:\n{node.log_tail()}")
                if time.monotonic() - started > startup_timeout_s:
                    raise RuntimeError(f"nats-server {node.name} not healthy in {startup_timeout_s:g} s:\n"
                                       f"{node.log_tail()}")  # fmt: skip
                time.sleep(0.2)  # each failed /healthz is a warning in the node's log
        for node in nodes:  # the first MQTT client creates the MQTT streams: pay that here, and prove each node
            _check_mqtt(node, startup_timeout_s - (time.monotonic() - started))
    except BaseException:
        cluster.stop()
        raise
    log.info("nats cluster started nodes=%d addresses=%s seconds=%.2f", size, cluster.address,
             time.monotonic() - started)  # fmt: skip
    return cluster
