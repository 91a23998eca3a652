"""Helpers shared by tests against a live broker, live daemons or the CLI as a process (tests/fedharness.py
runs the federation itself).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.config import load_agent_config
from agent.peer.node import PeerNode
from agent.runner import in_process_runner
from models.weights import NamedArrays, float_part
from participant.trainer import Trainer, TrainerWrapper
from protocol.messages import ServerStatus
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.peer_messages import PeerMember
from security.envelope import InvalidEnvelope, Opener
from security.keys import Identity, Keyring, PublicIdentity
from security.pki import Issued, issue
from security.signing import sign_document
from sim.broker import free_port, start_broker
from sim.federation import SimSettings
from sim.peer_federation import create_peer_federation
from skyfed import main
from tests.fedharness import override_toml, round_task, wait_until
from tests.tlsharness import add_observer

ROOT = Path(__file__).resolve().parent.parent
FED = "fleet"


# --- what is on the wire, a slow trainer, the server as a process
class Sniffer:
    """A raw paho subscriber on ``skyfed/#`` that keeps every payload it sees."""

    def __init__(self, broker) -> None:  # noqa: ANN001
        self.payloads: list[tuple[str, bytes]] = []
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="sniffer")
        self.client.on_connect = lambda c, *_: c.subscribe("skyfed/#", qos=1)
        self.client.on_message = lambda c, u, m: self.payloads.append((m.topic, m.payload))
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def float_windows(arrays: dict[str, np.ndarray], width: int = 16) -> set[bytes]:
    """Every 4-byte-aligned run of ``width`` bytes of the model's floating tensors that is evidence of
    plaintext: runs of mostly zeros (fresh BatchNorm, deltas of untouched values) also occur in a sealed
    message's own header (its zero digest field, say), so a run needs at least 8 distinct bytes."""
    windows = set()
    for value in float_part(arrays).values():
        raw = np.ascontiguousarray(value, dtype=np.float32).tobytes()
        windows.update(raw[i : i + width] for i in range(0, len(raw) - width + 1, 4))
    return {w for w in windows if len(set(w)) >= 8}


def leaks(payload: bytes, windows: set[bytes], width: int = 16) -> bool:
    return any(payload[i : i + width] in windows for i in range(len(payload) - width + 1))


class SlowInRound(TrainerWrapper):
    """A real trainer that starts late in one round (every round for None), so the test can act while that
    round is open, whatever the training itself takes: ``delay_s`` later, or once ``until`` holds (at most 120 s),
    for a lateness counted in the server's rounds, which take 0.1 s or 1 s as the machine goes."""

    def __init__(self, inner: Trainer, round_number: int | None, delay_s: float = 0.0,
                 until: Callable[[], bool] | None = None) -> None:  # fmt: skip
        super().__init__(inner)
        self.round_number, self.delay_s, self.until = round_number, delay_s, until

    def train(self, global_arrays, task, context=None):  # noqa: ANN001, ANN201
        if self.round_number in (None, task.round):
            time.sleep(self.delay_s)
            deadline = time.monotonic() + 120
            while self.until is not None and not self.until() and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.inner.train(global_arrays, task)


def checkpointed_round(server_state: Path) -> tuple[int, list[str]]:
    """The open round's number and its accepted updates (``agent``, or ``agent@round`` for a late one) as the
    server's checkpoint has them now; ``(0, [])`` between rounds or before the first checkpoint."""
    try:
        rs = json.loads((server_state / "checkpoint" / "state.json").read_text())["round_state"]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0, []
    if not rs:
        return 0, []
    return rs["round"], [f"{u['agent']}@{u['late_from']}" if u.get("late_from") else u["agent"] for u in rs["updates"]]


def kill_9_and_restart(server: subprocess.Popen, config: Path, log: Path) -> subprocess.Popen:
    """``kill -9`` the server process and start it again on the same config (the caller waits for it)."""
    os.kill(server.pid, signal.SIGKILL)
    server.wait(10)
    return start_server_process(config, log)


def start_server_process(config: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "skyfed", "server", "run", "--config", str(config)],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,  # noqa: SIM115
    )


# --- the models agents start from, and who can open a sealed inbox message
class Recording(TrainerWrapper):
    """Keeps a copy of every start model (and FedAMN context) a trainer is given, by round."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        super().__init__(inner)
        self.bases = {}
        self.contexts = {}

    def train(self, base, task, context=None):  # noqa: ANN001, ANN201
        self.bases[task.round] = {k: v.copy() for k, v in base.items()}
        self.contexts[task.round] = context
        return self.inner.train(base, task, context)


def record_local_models(agent) -> list[NamedArrays]:  # noqa: ANN001
    return record_slot(agent, "local")


def assert_each_opens_only_for_its_owner(starts: list[tuple[str, bytes]], identities: dict[str, Identity],
                                         server: PublicIdentity) -> None:  # fmt: skip
    """Every sealed inbox payload ``(owner, payload)`` opens for its owner and for no other agent."""
    for owner, payload in starts:
        for name, identity in identities.items():
            opener = Opener(identity=identity, federation="it", senders=Keyring([server]))
            if name == owner:
                opener.open_chunk(payload)
            else:
                with pytest.raises(InvalidEnvelope):
                    opener.open_chunk(payload)


def identical(a: NamedArrays, b: NamedArrays) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def record_slot(agent, slot: str) -> list[NamedArrays]:  # noqa: ANN001
    """Copies of every model ``agent`` keeps in ``slot``, in order."""
    saved: list[NamedArrays] = []
    save = agent.client.store.save_model

    def recording(name: str, arrays: NamedArrays, round_number: int, *named: str) -> None:
        if name == slot:
            saved.append({k: v.copy() for k, v in arrays.items()})
        save(name, arrays, round_number, *named)

    agent.client.store.save_model = recording
    return saved


# --- a server-signed round task
def signed_task(server: Identity, *, issued_at: float, expires_at: float | None = None, **fields: object) -> bytes:
    expires = issued_at + 360 if expires_at is None else expires_at
    fields = {"selected": ["agent-01"], "pending": ["agent-01"], "run_id": "run-a", **fields}
    task = round_task(issued_at=issued_at, deadline=issued_at + 60, expires_at=expires, **fields)
    return json.dumps(sign_document(task.to_dict(), server)).encode()


# --- peer federations
def peer_configs(tmp_path: Path, broker, agents: int = 3, **plan: object) -> dict[str, Path]:  # noqa: ANN001
    settings = SimSettings(mode="peer", agents=agents, rounds=1, partition="iid", epochs=1)
    layout = create_peer_federation(tmp_path / "fed", settings, (broker.host, broker.port))
    for path in layout.agent_configs.values():
        override_toml(path, federation={"join_wait_s": 1.0, "round_timeout_s": 20.0, "threshold": agents,
                                        "bounds": {"clip": "off", "sample_multiple": 0}, **plan})  # fmt: skip
    return layout.agent_configs


class Peers:
    """Peer daemons on threads; ``stop`` ends them all."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.nodes: dict[str, PeerNode] = {}
        self.threads: list[threading.Thread] = []

    def start(self, config_path: Path, wrap=None) -> PeerNode:  # noqa: ANN001
        config = load_agent_config(config_path)
        node = PeerNode(config, runner=in_process_runner(config))
        if wrap is not None:
            node.runner.trainer = wrap(node.runner.trainer)
        self.nodes[node.id] = node
        thread = threading.Thread(target=node.run, args=(self.stop,), name=node.id)
        thread.start()
        self.threads.append(thread)
        return node

    def wait_done(self, names: list[str], timeout_s: float = 90.0) -> None:
        wait_until(lambda: all(self.nodes[n].work.done for n in names), timeout_s, "the peers to finish")

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)


def state(config: Path) -> Path:
    return config.parent / "state"


HONEST = ["agent-02", "agent-03"]


@pytest.fixture
def peers():
    running = Peers()
    yield running
    running.close()


def seen_by(peers: Peers, viewer: str, peer: str) -> PeerMember | None:
    """``peer``'s signed membership as ``viewer`` received and verified it."""
    return peers.nodes[viewer].roster.members.get(peer)


# --- a provisioned federation and its broker, from `skyfed provision`'s files
@pytest.fixture
def workdir():
    """A world-traversable temporary folder: mosquitto, run as root, drops to its own user to read certificates."""
    base = Path(tempfile.mkdtemp(prefix="skyfed-provision-"))
    os.chmod(base, 0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


PEER_MODE = ("--mode", "peer")


def provision_exit(out: Path, agents: str, port: int = 8883, mode: tuple[str, ...] = (),
                   state: Path | None = None) -> int:  # fmt: skip
    """``skyfed provision``'s exit code; ``mode`` as on its command line (none: as the folder was made, client
    for a new one), the state folder next to ``out`` unless given."""
    argv = ["provision", *mode, "--federation", FED, "--agents", agents, "--out", str(out),
            "--broker", f"127.0.0.1:{port}", "--listen", "127.0.0.1", "--state-dir", str(state or out.parent / "state"),
            "--any-state-dir"]  # fmt: skip
    return main(argv)


def provision(out: Path, agents: str, port: int, state: Path) -> None:
    assert provision_exit(out, agents, port, state=state) == 0


def broker_from_files(out: Path, workdir: Path, port: int):  # noqa: ANN201
    """A mosquitto run from the provisioned folder's own config, with an ``observer`` certificate added."""
    issue(Issued(out / "ca" / "ca.crt", out / "ca" / "ca.crt.key"), out / "observer", "observer")
    shutil.copyfile(out / "ca" / "ca.crt", out / "observer" / "ca.crt")
    add_observer(out)
    return start_broker(
        data_dir=workdir / "broker-run", kind="mosquitto", port=port, config_file=out / "broker" / "skyfed.conf"
    )


@pytest.fixture
def provisioned(workdir):
    """A federation from ``skyfed provision`` (a1-a3, an observer) and a mosquitto run from its own config."""
    port = free_port()
    out, state = workdir / "fed", workdir / "state"
    provision(out, "a1,a2,a3", port, state)
    broker = broker_from_files(out, workdir, port)
    yield out, state, broker, port
    broker.stop()
    print(f"--- broker log ---\n{broker.log_tail(40)}")


@pytest.fixture
def peer_broker(workdir):
    """A peer federation from ``skyfed provision --mode peer`` (p1-p3, an observer) and its mosquitto."""
    port = free_port()
    out = workdir / "fed"
    assert provision_exit(out, "p1,p2,p3", port, PEER_MODE) == 0
    broker = broker_from_files(out, workdir, port)
    yield out, broker, port
    broker.stop()
    print(f"--- broker log ---\n{broker.log_tail(40)}")


# --- the CLI as a process
def skyfed(*args, timeout=180, columns=80):
    env = {**os.environ, "COLUMNS": str(columns)}  # the width rich lays tables out in
    return subprocess.run(
        [sys.executable, "-m", "skyfed", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env
    )


def metrics_rows(out):
    """The sim's ``metrics.jsonl``, one dict per round."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# --- the monitor's view: retained messages and the CLI as a running process
def mqtt_publisher(broker) -> paho.Client:  # noqa: ANN001
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="test-publisher")
    client.connect(broker.host, broker.port)
    client.loop_start()
    return client


def status_payload(federation: str) -> bytes:
    return ServerStatus(state="running", federation=federation, round=3, phase="training", strategy="fedavg",
                        model_version=2, agents_online=1, updated_at=time.time()).to_json()  # fmt: skip


def cli_popen(*args: str, **kwargs: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "skyfed", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)  # fmt: skip


def retain_all(broker, messages: dict[str, bytes]) -> None:  # noqa: ANN001
    publisher = mqtt_publisher(broker)
    for topic, payload in messages.items():
        publisher.publish(topic, payload, qos=1, retain=True).wait_for_publish(5)
    publisher.loop_stop()
    publisher.disconnect()


# --- the Prometheus endpoint
def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample the endpoint serves, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def scrape_or_none(port: int) -> dict[tuple[str, tuple], float] | None:
    try:
        return scrape(port)
    except (urllib.error.URLError, ConnectionError):
        return None


# --- an MQTT client's connection problem
def problem_of(settings: BrokerSettings, timeout_s: float = 15) -> str:
    """The first connection problem a client with ``settings`` reports."""
    client = MqttClient("probe", settings, persistent=False)
    client.start()
    try:
        return wait_until(lambda: client.problem, timeout_s, "a connection problem")
    finally:
        client.stop()
