"""Agents against replayed tasks and their own crashes, over a real broker."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from models.serialization import dumps
from models.weights import fingerprint
from protocol.messages import AgentStart
from protocol.mqtt import BrokerSettings, MqttClient
from security.envelope import seal
from security.keys import GroupKey, Identity
from security.signing import sign_document
from sim.federation import SimSettings, create_federation
from tests.fedharness import Federation, hosted_agent, round_task, wait_until
from tests.liveharness import SlowInRound, signed_task


class StaleTaskReplayer:
    """Anyone with publish rights on ``round``: keeps the first genuine task and re-publishes it, retained,
    after every newer task it sees."""

    def __init__(self, broker, federation: str) -> None:  # noqa: ANN001
        self.topic = f"skyfed/{federation}/round"
        self.client = MqttClient("replayer", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
        self.client.subscribe(self.topic)
        assert self.client.start(timeout_s=5)
        self.first: bytes | None = None
        self.seen: set[bytes] = set()
        self.replays = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            message = self.client.poll(0.05)
            if message is None or not message[1]:
                continue
            payload = message[1]
            if self.first is None:
                self.first = payload
            elif payload != self.first and payload not in self.seen:
                self.seen.add(payload)
                self.client.publish(self.topic, self.first, retain=True)
                self.replays += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.client.stop()


def retained(broker, pattern: str, quiet_s: float = 0.5) -> dict[str, bytes]:  # noqa: ANN001
    """What the broker holds retained under ``pattern``, as a fresh subscriber sees it."""
    reader = MqttClient(
        f"reader-{time.monotonic_ns()}", BrokerSettings(host=broker.host, port=broker.port), persistent=False
    )
    reader.subscribe(pattern)
    assert reader.start(timeout_s=5)
    try:
        found = {}
        while (message := reader.poll(quiet_s)) is not None:
            found[message[0]] = message[1]
        return found
    finally:
        reader.stop()


def retained_round(broker, federation: str) -> int:  # noqa: ANN001
    """The retained task's round; -1 while none is retained (between a clear and the server's put-back)."""
    payloads = list(retained(broker, f"skyfed/{federation}/round").values())
    return json.loads(payloads[0])["body"]["round"] if payloads else -1


def test_a_replayed_old_task_neither_stalls_the_agents_nor_stays_retained(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=3, agents=2)
    fed.agents[1].runner.trainer = SlowInRound(fed.agents[1].runner.trainer, round_number=2, delay_s=3.0)
    server = Aggregator(load_server_config(fed.layout.server_config))
    replayer = StaleTaskReplayer(broker, "it")
    server_thread = threading.Thread(target=server.run, daemon=True)
    server_thread.start()
    fed.start_agents()
    try:
        wait_until(lambda: replayer.replays >= 1 and server.engine.round_state is not None, 60, "a replay")
        wait_until(lambda: retained_round(broker, "it") >= 2, 10, "the server to put its task back")
        server_thread.join(90)
        assert not server_thread.is_alive(), "the federation did not finish"
    finally:
        replayer.close()
        fed.close()
    metrics = fed.metrics()
    assert [m.round for m in metrics] == [1, 2, 3]
    assert all(sorted(m.accepted) == ["agent-01", "agent-02"] for m in metrics)
    assert all(m.duration_s < 30 for m in metrics), [m.duration_s for m in metrics]  # deadline is 60 s
    assert replayer.replays >= 2


def test_an_update_trained_before_a_crash_is_sent_at_restart_without_waiting_for_a_reannounce(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=1, agents=3)  # quorum 1: the others alone could close at 60 s
    victim = fed.agents[0]
    victim_stop = threading.Event()

    def power_loss(task, data):  # noqa: ANN001 - trained and stored, then the process died before sending
        victim_stop.set()
        raise RuntimeError("simulated power loss")

    victim._send = power_loss
    victim_thread = threading.Thread(target=victim.run, args=(victim_stop,), daemon=True)
    others = [threading.Thread(target=a.run, args=(fed.stop,), daemon=True) for a in fed.agents[1:]]
    server = Aggregator(load_server_config(fed.layout.server_config))
    server_thread = threading.Thread(target=server.run, daemon=True)
    for thread in (server_thread, victim_thread, *others):
        thread.start()
    try:
        victim_thread.join(60)
        assert victim.client.progress.last_completed_round == 1 and victim.client.progress.sent_round == 0
        wait_until(lambda: len(server.engine.round_state.updates) == 2, 30, "the other two updates")
        restarted = hosted_agent(fed.layout.agent_configs[victim.id])
        restarted_thread = threading.Thread(target=restarted.run, args=(fed.stop,), daemon=True)
        restarted_thread.start()
        server_thread.join(30)
        assert not server_thread.is_alive(), "the round waited for its deadline: the stored update was not re-sent"
    finally:
        fed.close()
    (round_1,) = fed.metrics()
    assert sorted(round_1.accepted) == ["agent-01", "agent-02", "agent-03"] and round_1.duration_s < 30
    restarted_thread.join(10)  # its last tick (or its stop) records the broker's acknowledgement
    assert restarted.client.progress.sent_round == 1


def test_the_newest_task_survives_an_agent_restart_and_older_or_expired_ones_are_ignored(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    server = Identity.load(layout.server_config.parent / "server.key")
    config = layout.agent_configs["agent-01"]
    now = time.time()
    agent = hosted_agent(config)
    agent._on_task(signed_task(server, round=3, issued_at=now))
    agent._on_task(signed_task(server, round=1, issued_at=now + 5))  # replayed: older round of the same run
    assert (agent.task.round, agent.task.attempt) == (3, 1)
    agent._on_task(signed_task(server, round=3, attempt=2, issued_at=now + 1))
    events = []
    agent._step = lambda: events.append("step")  # where a selected agent starts its training job
    save = agent.client.store.save_task
    agent.client.store.save_task = lambda document: (events.append("saved"), save(document))
    agent.tick()
    assert events == ["step", "saved"]  # durably, by the end of the tick, but after the job started
    restarted = hosted_agent(config)
    assert (restarted.task.round, restarted.task.attempt) == (3, 2)  # from task.json
    restarted._on_task(signed_task(server, round=2, attempt=9, issued_at=now + 2))
    restarted._on_task(signed_task(server, round=4, issued_at=now - 900, expires_at=now - 300))
    assert (restarted.task.round, restarted.task.attempt) == (3, 2)
    assert "clock" in restarted.detail
    restarted.client.progress.last_completed_round = 3
    restarted._on_task(signed_task(server, round=1, run_id="run-b", issued_at=now + 10))  # the server was reset
    assert (restarted.task.round, restarted.task.run_id) == (1, "run-b")
    assert restarted.client.progress.last_completed_round == 0  # a new run starts over
    restarted._on_task(signed_task(server, round=5, run_id="run-a", issued_at=now + 3))  # the old run, replayed
    assert restarted.task.run_id == "run-b"


def test_the_server_puts_back_a_model_someone_cleared_and_a_task_replaced_twice_in_a_second(
    tmp_path, broker, monkeypatch, caplog
):
    from broker_server.agents import delivery

    monkeypatch.setattr(delivery, "MODEL_STALL_S", 2.0)
    fed = Federation(tmp_path, broker, rounds=1, agents=2)
    for agent in fed.agents:  # round 1 stays open while the task is replaced (the model is back at once)
        agent.runner.trainer = SlowInRound(agent.runner.trainer, round_number=1, delay_s=3.0)
    server = Aggregator(load_server_config(fed.layout.server_config))
    server_thread = threading.Thread(target=server.run, daemon=True)
    server_thread.start()
    outsider = MqttClient("outsider", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
    assert outsider.start(timeout_s=5)
    try:
        wait_until(lambda: server.publisher.current is not None, 20, "the model to be published")
        chunks = server.publisher.current.chunks  # queued by the server's client: wait until the broker has them
        wait_until(lambda: len(retained(broker, "skyfed/it/model/1/#")) == chunks, 10, "the model to be retained")
        cleared = [outsider.publish(f"skyfed/it/model/1/{i}", b"", retain=True) for i in range(chunks)]
        assert MqttClient.wait_published(cleared, 5)  # the retained model is gone before any agent came
        fed.start_agents()
        wait_until(lambda: server.engine.round_state is not None and server.tasks.payload, 30, "round 1 announced")
        stale = json.dumps(sign_document(round_task(round=0, run_id=server.engine.run_id).to_dict(), server.identity))
        for _ in range(2):  # twice within a second: the second lands while the first put-back is throttled
            outsider.wait_published([outsider.publish("skyfed/it/round", stale.encode(), retain=True)], 5)
            time.sleep(0.3)
        wait_until(lambda: retained_round(broker, "it") == 1, 10, "the current task to be retained again")
        server_thread.join(60)
        assert not server_thread.is_alive(), "the agents never got the model back"
    finally:
        outsider.stop()
        fed.close()
    assert sorted(fed.metrics()[0].accepted) == ["agent-01", "agent-02"]
    assert "re-published it" in caplog.text


def test_a_model_healed_after_its_task_was_signed_is_the_one_the_task_names_and_the_waiting_agents_train(
    tmp_path, broker, monkeypatch, caplog
):
    """Every re-publication of the current model is the plaintext its signed task names: a heal that
    re-serialized it into other bytes left agents ``waiting-model`` until the deadline."""
    from broker_server.agents import delivery

    monkeypatch.setattr(delivery, "MODEL_STALL_S", 10.0)  # the second heal comes after the task is signed
    fed = Federation(tmp_path, broker, rounds=1, agents=2)
    server = Aggregator(load_server_config(fed.layout.server_config))
    server_thread = threading.Thread(target=server.run, daemon=True)
    server_thread.start()
    outsider = MqttClient("outsider", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
    assert outsider.start(timeout_s=5)

    def clear_when_retained(chunks: int) -> None:  # the server's own publishes reached the broker first
        wait_until(lambda: len(retained(broker, "skyfed/it/model/1/#")) == chunks, 10, "the model to be retained")
        cleared = [outsider.publish(f"skyfed/it/model/1/{i}", b"", retain=True) for i in range(chunks)]
        assert MqttClient.wait_published(cleared, 5)

    try:
        wait_until(lambda: server.publisher.current is not None, 20, "the model to be published")
        first = server.publisher.current
        clear_when_retained(first.chunks)
        wait_until(lambda: caplog.text.count("re-published it") == 1, 10, "the first heal")
        clear_when_retained(first.chunks)  # again: this time the heal waits MODEL_STALL_S
        fed.start_agents()
        wait_until(lambda: server.engine.round_state is not None and server.tasks.payload, 30, "round 1 announced")
        task_sha = json.loads(server.tasks.payload)["body"]["model_sha256"]
        assert caplog.text.count("re-published it") == 1, "the task was meant to be signed before the second heal"
        server_thread.join(40)  # well inside the 60 s deadline: the agents trained from the healed model
        assert not server_thread.is_alive(), "the agents waited for a model their task does not name"
    finally:
        outsider.stop()
        fed.close()
    heals = re.findall(r"re-published it sha256=(\w+)", caplog.text)
    assert heals == [first.sha256[:12]] * 2 and task_sha == first.sha256  # the same bytes every time
    assert sorted(fed.metrics()[0].accepted) == ["agent-01", "agent-02"]


def test_an_agent_keeps_its_newer_model_when_an_older_one_is_replayed(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    server = Identity.load(layout.server_config.parent / "server.key")
    agent = hosted_agent(layout.agent_configs["agent-01"])
    key = GroupKey.generate()
    agent.group_keys[key.key_id] = key
    sealed = {
        version: seal(
            dumps({"w": np.full(4, version, np.float32)}),
            sender=server,
            federation="it",
            kind="model",
            round=version,
            group_key=key,
        )[1]  # fmt: skip
        for version in (1, 2)
    }
    for chunk in sealed[2]:
        agent.handle(f"skyfed/it/model/2/{0}", bytes(chunk))
    for chunk in sealed[1]:
        agent.handle("skyfed/it/model/2/0", bytes(chunk))  # replayed under the newer version's topic
        agent.handle("skyfed/it/model/999/0", bytes(chunk))  # or under a version of its own
    assert list(agent.models) == [2]
    agent._on_task(signed_task(server, issued_at=time.time(), model_version=1))  # the server says: use 1
    for chunk in sealed[1]:
        agent.handle("skyfed/it/model/1/0", bytes(chunk))
    assert list(agent.models) == [1]


def test_a_start_model_is_kept_across_a_restart_and_an_older_rounds_one_is_ignored(tmp_path):
    """Swapping: a model sealed to this agent is kept on disk and found by the fingerprint the task names;
    one sealed for an older round than the task's (a replay) cannot evict it; another agent's key opens nothing."""
    layout = create_federation(tmp_path, SimSettings(agents=2, rounds=1, federation="it"), ("127.0.0.1", 1))
    server = Identity.load(layout.server_config.parent / "server.key")
    agent = hosted_agent(layout.agent_configs["agent-01"])
    models = {r: {"w": np.full(4, r, np.float32)} for r in (2, 3)}
    sealed = {
        r: seal(dumps(m), sender=server, federation="it", kind="start", round=r, recipient=agent.identity.public)[1]
        for r, m in models.items()
    }
    start = AgentStart(agent="agent-01", source="inbox", sha256=fingerprint(models[3]))
    task = signed_task(server, round=3, issued_at=time.time(), action="swap", starts=[start])
    agent._on_task(task)
    for chunk in sealed[3]:
        agent.handle("skyfed/it/agent/agent-01/inbox", bytes(chunk))
    for chunk in sealed[2]:
        agent.handle("skyfed/it/agent/agent-01/inbox", bytes(chunk))  # replayed from an older round
    agent._save_task()  # as the daemon's tick does, once its step has acted on the task
    restarted = hosted_agent(layout.agent_configs["agent-01"])
    found = restarted.inbox.start_model(restarted.task, restarted.task.start_of("agent-01"))
    assert found is not None and np.array_equal(found["w"], models[3]["w"])
    other = hosted_agent(layout.agent_configs["agent-02"])
    for chunk in sealed[3]:
        other.handle("skyfed/it/agent/agent-02/inbox", bytes(chunk))  # sealed to agent-01: does not open
    assert other.client.start_models.find(fingerprint(models[3])) is None
