"""Test helpers: a real aggregator (in a thread) on a real broker, driven by test-controlled agents.

The test plays the agents itself with real keys and real sealed transfers, so it knows exactly which
updates are valid and can check the resulting global model against a direct numpy computation.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np

from agent.config import load_agent_config
from agent.daemon import EdgeAgent
from agent.runner import in_process_runner
from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from common import toml
from flcore.update import UpdateMeta
from models.serialization import dumps, load_file
from models.weights import delta as weights_delta
from models.weights import float_part
from protocol.config import write_toml
from protocol.messages import AgentStatus, RoundMetrics, RoundTask
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import Topics
from security.envelope import seal
from security.keys import Identity
from security.signing import signed_payload
from sim.federation import SimSettings, create_federation


def hosted_agent(config_path: Path) -> EdgeAgent:
    """An agent daemon whose trainer runs in the test's process (as ``sim.agent_host`` hosts them): tests
    swap ``agent.runner.trainer`` and skip a training child's start-up per round. The child itself is
    tested in tests/test_training_child.py."""
    config = load_agent_config(config_path)
    return EdgeAgent(config, runner=in_process_runner(config))


def round_task(**overrides: object) -> RoundTask:
    """A well-formed round task for federation ``it``; tests override what they exercise."""
    now = time.time()
    fields: dict = {
        "federation": "it",
        "round": 1,
        "attempt": 1,
        "strategy": "fedavg",
        "model": "digits_cnn",
        "num_classes": 10,
        "model_version": 1,
        "model_sha256": "00" * 32,
        "model_chunks": 1,
        "group_key_id": "deadbeef",
        "selected": ["agent-01", "agent-02"],
        "pending": ["agent-01", "agent-02"],
        "deadline": now + 60,
        "issued_at": now,
        "expires_at": now + 360,
    }
    return RoundTask(**{**fields, **overrides})


def round_metrics(**overrides: object) -> RoundMetrics:
    """A well-formed metrics line; tests override what they exercise."""
    fields: dict = {
        "round": 1,
        "strategy": "fedavg",
        "participants": ["a"],
        "accepted": ["a"],
        "rejected": [],
        "duration_s": 1.0,
        "aggregate_s": 0.0,
        "bytes_up": 0,
        "bytes_down": 0,
        "eval": {},
        "model_version": 2,
        "finished_at": 0.0,
    }
    return RoundMetrics(**{**fields, **overrides})


def wait_until(predicate, timeout_s: float = 20.0, what: str = "condition"):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def override_toml(path: Path, **tables: dict) -> None:
    data = toml.loads(path.read_text())
    for name, values in tables.items():
        data.setdefault(name, {}).update(values)
    write_toml(path, data)


class ServerHarness:
    """An Aggregator thread plus a driver MQTT client that plays the agents."""

    def __init__(self, root: Path, broker, *, agents: int = 2, rounds: int = 1,  # noqa: ANN001
                 round_rules: dict | None = None, **overrides: dict) -> None:  # fmt: skip
        settings = SimSettings(agents=agents, rounds=rounds, federation="t", deadline_s=30.0)
        self.layout = create_federation(root, settings, (broker.host, broker.port))
        # FedAvg unless a test says otherwise: its exact, sample-weighted result is what tests compare against
        overrides.setdefault("strategy", {"name": "fedavg"})
        # and no screening of small rounds on the server's evaluation set: random deltas raise its loss
        overrides["bounds"] = {"screen_below": 0, **overrides.get("bounds", {})}
        override_toml(self.layout.server_config, rounds={"quorum": agents, **(round_rules or {})}, **overrides)
        self.config = load_server_config(self.layout.server_config)
        self.server = Aggregator(self.config)
        self.initial = {k: v.copy() for k, v in self.server.engine.global_arrays.items()}
        self.topics = Topics("t")
        self.agents = {name: Identity.load(root / name / f"{name}.key") for name in self.layout.agent_configs}
        self.stop = threading.Event()
        self.server_stop = threading.Event()
        self.thread = threading.Thread(target=self.server.run, args=(self.server_stop,), daemon=True)
        self.metrics: list[RoundMetrics] = []
        self.tasks: list[RoundTask] = []
        self.driver = MqttClient("test-driver", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
        self.driver.subscribe(self.topics.server_metrics)
        self.driver.subscribe(self.topics.round)
        self._listen = threading.Thread(target=self._collect, daemon=True)

    def __enter__(self) -> ServerHarness:
        assert self.driver.start(timeout_s=10)
        self._listen.start()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.server_stop.set()
        self.thread.join(15)
        self.driver.stop()

    def restart_server(self) -> None:
        """Stop the aggregator cleanly and start a new one on the same state directory (a restart)."""
        self.server_stop.set()
        self.thread.join(15)
        assert not self.thread.is_alive()
        self.server = Aggregator(self.config)
        self.server_stop = threading.Event()
        self.thread = threading.Thread(target=self.server.run, args=(self.server_stop,), daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        while not self.stop.is_set():
            message = self.driver.poll(0.05)
            if message is None:
                continue
            topic, payload = message
            if topic == self.topics.server_metrics:
                self.metrics.append(RoundMetrics.from_json(payload))
            elif topic == self.topics.round and payload:
                self.tasks.append(RoundTask.from_dict(json.loads(payload)["body"]))

    # playing the agents ----------------------------------------------------------------------------
    def announce_agents(self) -> RoundTask:
        for name in self.agents:
            status = AgentStatus(
                agent=name,
                state="idle",
                round=0,
                samples=100,
                version=1,
                updated_at=time.time(),
                group_key_id=self.server.group_keys.key.key_id,
            )
            payload = signed_payload(status.to_dict(), self.agents[name])  # as the agent signs it
            self.driver.publish(self.topics.agent_status(name), payload, retain=True)
        return wait_until(lambda: self.tasks and self.tasks[-1], what="a round task")

    def update_bytes(self, delta: dict[str, np.ndarray], *, round_number: int = 1, samples: int = 100) -> bytes:
        """An update's plaintext, against the server's current model version."""
        meta = UpdateMeta(round=round_number, base_version=self.server.engine.version, samples=samples, loss=0.5)
        return dumps(delta, metadata=meta.to_metadata())

    def random_delta(self, seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        floats = float_part(self.initial)
        local = {k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in floats.items()}
        return {k: (d * np.float32(scale)).astype(np.float32) for k, d in weights_delta(local, floats).items()}

    def send(self, agent: str, delta: dict[str, np.ndarray], *, round_number: int = 1, samples: int = 100) -> None:
        """Play ``agent``: seal ``delta`` as its update and publish it on its topic."""
        data = self.update_bytes(delta, round_number=round_number, samples=samples)
        self.publish_update(agent, self.sealed(self.agents[agent], data, round_number=round_number))

    def sealed(
        self,
        sender: Identity,
        data: bytes,
        *,
        federation: str = "t",
        round_number: int = 1,
        chunk_size: int = 1 << 20,
        age_s: float = 0.0,  # back-dates the signed manifest: an older transfer supersedes no unfinished one
    ) -> list[bytes]:
        _, chunks = seal(
            data,
            sender=sender,
            federation=federation,
            kind="update",
            round=round_number,
            recipient=self.server.identity.public,
            chunk_size=chunk_size,
            now=time.time() - age_s,
        )
        return chunks

    def publish_update(self, agent: str, chunks: list[bytes]) -> None:
        infos = self.driver.publish_all((self.topics.agent_update(agent), c) for c in chunks)
        assert MqttClient.wait_published(infos, 10)

    def wait_rejection(self, reason: str) -> None:
        wait_until(lambda: self.server.rejections.get(reason, 0) > 0, what=f"rejection {reason!r}")

    def wait_metrics(self, count: int = 1) -> RoundMetrics:
        return wait_until(lambda: len(self.metrics) >= count and self.metrics[count - 1], what="round metrics")

    def final_model(self) -> dict[str, np.ndarray]:
        self.thread.join(15)
        arrays, _ = load_file(self.config.state_dir / "global_model.safetensors")
        return arrays

    def expected_model(
        self, deltas: list[dict[str, np.ndarray]], samples: list[float], scales: list[float] | None = None
    ) -> dict[str, np.ndarray]:
        """FedAvg computed directly: initial + sum(n_i * s_i * delta_i) / sum(n_i), in float64."""
        total = sum(samples)
        scales = scales or [1.0] * len(deltas)
        out = {}
        for name, value in self.initial.items():
            if np.issubdtype(value.dtype, np.floating):
                terms = zip(samples, scales, deltas, strict=True)
                avg = sum(n * s * d[name].astype(np.float64) for n, s, d in terms) / total
                out[name] = (value + avg).astype(value.dtype)
            else:
                out[name] = value
        return out


class Federation:
    """Agents as threads in this process; the server either as a thread or as a subprocess."""

    def __init__(
        self,
        tmp_path: Path,
        broker,
        *,
        rounds: int,
        agents: int = 3,
        epochs: int = 1,  # noqa: ANN001
        partition: str = "iid",
        protocol: str = "3.1.1",
        edit=None,  # noqa: ANN001 - called with the layout before the agents are built (config edits)
        **settings: object,  # other SimSettings fields (task, image_size, …)
    ) -> None:
        settings = SimSettings(agents=agents, rounds=rounds, partition=partition, epochs=epochs, federation="it",
                               deadline_s=60.0, **settings)  # fmt: skip
        self.layout = create_federation(tmp_path, settings, (broker.host, broker.port))
        for config in [self.layout.server_config, *self.layout.agent_configs.values()]:
            override_toml(config, broker={"protocol": protocol})
        if edit is not None:
            edit(self.layout)
        self.server_state = self.layout.server_config.parent / "state"
        self.stop = threading.Event()
        self.agents = [hosted_agent(p) for p in self.layout.agent_configs.values()]
        self.threads = [threading.Thread(target=a.run, args=(self.stop,), daemon=True) for a in self.agents]

    def start_agents(self) -> None:
        for t in self.threads:
            t.start()

    def start_with_server(self) -> tuple[Aggregator, threading.Thread]:
        """The server of the layout's config on a thread of its own, then every agent."""
        server = Aggregator(load_server_config(self.layout.server_config))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self.start_agents()
        return server, thread

    def run(self, server, timeout_s: float = 90) -> None:  # noqa: ANN001 - an Aggregator
        """Run ``server`` on a thread with every agent until it finishes its rounds (or fail)."""
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self.start_agents()
        try:
            thread.join(timeout_s)
            assert not thread.is_alive(), "the federation did not finish"
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            if t.ident is not None:  # tests may run some agents on threads of their own
                t.join(10)

    def metrics(self) -> list[RoundMetrics]:
        path = self.server_state / "metrics.jsonl"
        if not path.exists():
            return []
        return [RoundMetrics.from_json(line) for line in path.read_text().splitlines() if line]
