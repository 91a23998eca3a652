"""End to end over a real mosquitto: real agents (threads), a real aggregator, real training.

Covers: accuracy rises over rounds; nothing readable but JSON status on the wire and no run of the
model's float32 bytes in any payload; a broker restart and a ``kill -9`` of the server mid-round,
both finishing the run with no accepted update lost.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from models.datasets import load_dataset
from models.serialization import load_file, loads
from models.training import evaluate
from models.weights import load_arrays
from models.zoo import build_model, pick_device
from participant.trainer import Trainer, TrainerWrapper
from protocol.messages import RecipeRecord
from sim.broker import start_broker
from tests.fedharness import Federation, hosted_agent, round_task, wait_until
from tests.liveharness import (
    SlowInRound,
    Sniffer,
    checkpointed_round,
    float_windows,
    kill_9_and_restart,
    leaks,
    start_server_process,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("broker_kind, protocol", [("mosquitto", "3.1.1"), ("mosquitto", "5"), ("iotcore", "3.1.1")])
def test_three_agents_three_rounds_accuracy_rises_and_wire_carries_no_plaintext(
    tmp_path, broker, broker_kind, protocol
):
    if broker_kind == "iotcore":  # the embedded fallback `make demo` uses where mosquitto is not installed
        pytest.importorskip("iotcore")
        broker = start_broker(data_dir=tmp_path / "iotcore", kind="iotcore")
    fed = Federation(tmp_path, broker, rounds=3, protocol=protocol)
    sniffer = Sniffer(broker)
    server = Aggregator(load_server_config(fed.layout.server_config))
    test_data = load_dataset(fed.layout.server_config.parent / "test.npz")
    model = build_model("digits_cnn")
    load_arrays(model, server.engine.global_arrays)
    initial_accuracy = evaluate(model, test_data, pick_device())["accuracy"]
    model_snapshots = [dict(server.engine.global_arrays)]
    server_thread = threading.Thread(target=server.run, daemon=True)
    server_thread.start()
    fed.start_agents()
    try:
        server_thread.join(120)
        assert not server_thread.is_alive(), "the federation did not finish 3 rounds in 120 s"
    finally:
        fed.close()
        time.sleep(0.3)
        sniffer.close()
        if broker_kind == "iotcore":
            broker.stop()
    metrics = fed.metrics()
    accuracies = [m.eval["accuracy"] for m in metrics]
    assert [m.round for m in metrics] == [1, 2, 3]
    assert all(sorted(m.accepted) == sorted(m.participants) for m in metrics) and not any(m.rejected for m in metrics)
    assert accuracies[-1] > initial_accuracy + 0.3, (initial_accuracy, accuracies)
    assert accuracies[-1] >= accuracies[0]

    final, _ = load_file(fed.server_state / "global_model.safetensors")
    model_snapshots.append(final)
    for agent in fed.agents:  # each agent's last (plaintext) update, as kept on its own disk
        model_snapshots.append(loads(agent.client.store.stored_update(3))[0])
    windows = set().union(*(float_windows(s) for s in model_snapshots))
    assert len(windows) > 10_000
    readable = ("/status", "/metrics", "/history", "/round")  # JSON by design
    binary = [(t, p) for t, p in sniffer.payloads if p and not t.endswith(readable)]
    assert binary, "no model or update traffic was captured"
    for topic, payload in sniffer.payloads:
        if topic.endswith(readable) and payload:
            json.loads(payload)  # readable JSON, by design
        elif payload:
            assert payload[:3] == b"SKF", topic
            assert not leaks(payload, windows), f"plaintext model bytes on {topic}"


def test_broker_restart_mid_round_finishes_with_no_accepted_update_lost(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=3, epochs=3)
    server = Aggregator(load_server_config(fed.layout.server_config))
    server_thread = threading.Thread(target=server.run, daemon=True)
    server_thread.start()
    fed.start_agents()
    try:
        rounds = server.engine
        wait_until(lambda: rounds.round_state is not None and rounds.round_state.round == 2, 60, "round 2")
        broker.restart()
        server_thread.join(150)
        assert not server_thread.is_alive(), "the federation did not finish after the broker restart"
    finally:
        fed.close()
    metrics = fed.metrics()
    assert [m.round for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert sorted(m.accepted) == sorted(m.participants), m


@pytest.mark.timeout(240)
def test_server_kill_9_mid_round_resumes_with_no_accepted_update_lost(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=3)
    slow = fed.agents[0]
    slow.runner.trainer = SlowInRound(slow.runner.trainer, round_number=2, delay_s=8.0)
    log = tmp_path / "server.log"
    server = start_server_process(fed.layout.server_config, log)
    fed.start_agents()
    try:
        def accepted_in_round_2() -> list[str]:
            number, accepted = checkpointed_round(fed.server_state)
            return accepted if number == 2 else []

        before_kill = wait_until(accepted_in_round_2, 90, "an accepted update in round 2")
        server = kill_9_and_restart(server, fed.layout.server_config, log)
        assert slow.id not in before_kill
        assert server.wait(150) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
        fed.close()
    metrics = fed.metrics()
    assert [m.round for m in metrics] == [1, 2, 3]
    round_2 = metrics[1]
    assert set(before_kill) <= set(round_2.accepted)
    assert sorted(round_2.accepted) == sorted(round_2.participants)
    assert "server resumed" in log.read_text()


def test_agents_ignore_a_forged_round_task_then_follow_the_real_server(tmp_path, broker):
    from protocol.mqtt import BrokerSettings, MqttClient
    from security.keys import Identity
    from security.signing import sign_document

    fed = Federation(tmp_path, broker, rounds=1, agents=2)
    forged = round_task(model_sha256="00" * 32)
    attacker = MqttClient("attacker", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
    assert attacker.start(timeout_s=5)
    document = sign_document(forged.to_dict(), Identity.generate("server"))  # right name, wrong key
    attacker.wait_published([attacker.publish("skyfed/it/round", json.dumps(document).encode(), retain=True)], 5)
    attacker.stop()
    fed.start_agents()
    try:
        time.sleep(1.5)
        assert all(a.task is None and a.state == "idle" for a in fed.agents)
        server = Aggregator(load_server_config(fed.layout.server_config))
        server_thread = threading.Thread(target=server.run, daemon=True)
        server_thread.start()
        server_thread.join(60)
        assert not server_thread.is_alive()
    finally:
        fed.close()
    assert sorted(fed.metrics()[0].accepted) == ["agent-01", "agent-02"]


class CountingTrainer(TrainerWrapper):
    """The real trainer, recording which rounds it trained."""

    def __init__(self, inner: Trainer) -> None:
        super().__init__(inner)
        self.rounds = []

    def train(self, global_arrays, task, context=None):  # noqa: ANN001, ANN201
        self.rounds.append(task.round)
        return self.inner.train(global_arrays, task)


def test_agent_restart_neither_repeats_nor_skips_a_round(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=3, agents=2)
    first, other = fed.agents
    first.runner.trainer = CountingTrainer(first.runner.trainer)
    other.runner.trainer = SlowInRound(other.runner.trainer, round_number=2, delay_s=4.0)  # keeps round 2 open
    first_stop = threading.Event()
    first_thread = threading.Thread(target=first.run, args=(first_stop,), daemon=True)
    other_thread = threading.Thread(target=other.run, args=(fed.stop,), daemon=True)
    server = Aggregator(load_server_config(fed.layout.server_config))
    server_thread = threading.Thread(target=server.run, daemon=True)
    for t in (server_thread, first_thread, other_thread):
        t.start()
    try:
        wait_until(lambda: first.client.progress.last_completed_round == 2, 60, "agent-01 to finish round 2")
        first_stop.set()
        first_thread.join(10)
        assert server.engine.round_state is not None and server.engine.round_state.round == 2  # restarted mid-round
        restarted = hosted_agent(fed.layout.agent_configs[first.id])
        restarted.runner.trainer = CountingTrainer(restarted.runner.trainer)
        restarted_thread = threading.Thread(target=restarted.run, args=(fed.stop,), daemon=True)
        restarted_thread.start()
        server_thread.join(90)
        assert not server_thread.is_alive()
    finally:
        fed.stop.set()
        first_stop.set()
        for t in (first_thread, other_thread):
            t.join(10)
    assert first.runner.trainer.rounds == [1, 2]
    assert restarted.runner.trainer.rounds == [3]  # round 2 not repeated, round 3 not skipped
    assert [sorted(m.accepted) for m in fed.metrics()] == [["agent-01", "agent-02"]] * 3


def test_the_round_task_carries_what_the_strategy_configures(tmp_path, broker):
    from tests.fedharness import ServerHarness

    with ServerHarness(tmp_path, broker, strategy={"name": "fedprox", "mu": 0.05}) as h:
        task = h.announce_agents()
    assert task.strategy == "fedprox" and task.train.recipes == (RecipeRecord("proximal", {"mu": 0.05}),)


def test_a_threshold_closes_the_round_early_and_a_late_update_is_folded_into_the_next(tmp_path, broker):
    """SmartFed's static threshold: aggregate once K of the N selected updates are in (here 1 of 2; the round
    closes on the K-th update, not at the server's next tick). The other agent's update for that round, sent right
    behind the first, is folded into round 2 (``flcore.late``), which still closes on its own first update; the
    same transfer again is a replay."""
    from tests.fedharness import ServerHarness

    with ServerHarness(tmp_path, broker, rounds=2, strategy={"name": "fedavg", "threshold": 1}) as h:
        h.announce_agents()
        update = h.update_bytes(h.random_delta(1), samples=100)
        late = h.sealed(h.agents["agent-02"], update)
        h.publish_update("agent-01", h.sealed(h.agents["agent-01"], update))
        h.publish_update("agent-02", late)
        first = h.wait_metrics()
        wait_until(lambda: (rs := h.server.engine.round_state) is not None and rs.folded_late, what="a late fold")
        h.publish_update("agent-02", late)
        h.wait_rejection("replay")
        own = h.update_bytes(h.random_delta(2), round_number=2)
        h.publish_update("agent-01", h.sealed(h.agents["agent-01"], own, round_number=2))
        second = h.wait_metrics(2)
    assert len(first.accepted) == 1 and first.participants == ["agent-01", "agent-02"]
    assert second.accepted == ["agent-01"] and second.aggregation["folded_late"] == ["agent-02@1"]


@pytest.mark.timeout(180)
def test_an_agent_still_training_when_the_threshold_closes_its_round_finishes_and_is_folded_into_the_next(
        tmp_path, broker):  # fmt: skip
    """Real agents, threshold 2 of 3: round 2's task names the slow agent in ``late``, so it finishes its round-1
    training and sends it instead of stopping (it stopped on main: an agent always last never sent anything), and
    round 2 folds it in."""
    fed = Federation(tmp_path, broker, rounds=2, strategy={"name": "fedavg", "threshold": 2})
    slow, *fast = fed.agents
    slow.runner.trainer = SlowInRound(slow.runner.trainer, round_number=1, delay_s=10.0)
    for agent in fast:  # round 2 stays open until the slow agent's round 1 is in
        agent.runner.trainer = SlowInRound(agent.runner.trainer, round_number=2, delay_s=15.0)
    fed.run(Aggregator(load_server_config(fed.layout.server_config)), timeout_s=150)
    first, second = fed.metrics()
    assert slow.id not in first.accepted and second.aggregation["folded_late"] == [f"{slow.id}@1"]


def test_with_late_weight_0_a_late_update_is_refused_as_late(tmp_path, broker):
    """The old rule, kept by ``late_weight = 0``: the late update is refused, not carried into the next round."""
    from tests.fedharness import ServerHarness

    strategy = {"name": "fedavg", "threshold": 1, "late_weight": 0}
    with ServerHarness(tmp_path, broker, rounds=2, strategy=strategy) as h:
        h.announce_agents()
        update = h.update_bytes(h.random_delta(1), samples=100)
        h.publish_update("agent-01", h.sealed(h.agents["agent-01"], update))
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], update))
        first = h.wait_metrics()
        h.wait_rejection("late")
    assert len(first.accepted) == 1 and first.participants == ["agent-01", "agent-02"]


@pytest.mark.timeout(120)
def test_an_agent_acts_on_its_task_model_and_finished_training_at_once_not_on_its_next_tick(tmp_path, broker):
    """What an agent waits for wakes its loop (``MqttClient.wake``): the task, the model's last chunk, its
    training job ending. With ticks 10 minutes apart two rounds still close; on a tree without the wake-ups
    nothing happens until a tick, and the federation does not finish."""
    fed = Federation(tmp_path, broker, rounds=2, agents=2)
    for agent in fed.agents:
        agent.edge.tick_interval_s = 600.0
    server = Aggregator(load_server_config(fed.layout.server_config))
    try:
        fed.run(server, timeout_s=60)
    finally:
        for agent in fed.agents:  # their loops see the stop now, not in 10 minutes
            agent.edge.mqtt.wake()
    assert [sorted(m.accepted) for m in fed.metrics()] == [["agent-01", "agent-02"]] * 2


def test_the_server_publishes_its_status_on_changes_of_phase_not_on_each_accepted_update(tmp_path, broker):
    """Every agent subscribes to the server's retained status (to notice the run's end), so a publish per
    accepted update cost N agents x N updates deliveries a round: at 100 agents in one process, half the
    round (docs/results/scale.md). An accepted update changes none of the status's fields."""
    from protocol.messages import ServerStatus
    from protocol.mqtt import BrokerSettings, MqttClient
    from protocol.topics import Topics
    from tests.fedharness import override_toml

    def edit(layout) -> None:  # noqa: ANN001
        override_toml(layout.server_config, server={"status_interval_s": 3600})  # no periodic publish in the run

    fed = Federation(tmp_path, broker, rounds=2, agents=4, edit=edit)
    watcher = MqttClient("status-watcher", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
    watcher.subscribe(Topics("it").server_status)
    assert watcher.start(timeout_s=10)
    try:
        fed.run(Aggregator(load_server_config(fed.layout.server_config)))
        statuses = []

        def finished() -> bool:
            while (message := watcher.poll(0.05)) is not None:
                statuses.append(ServerStatus.from_json(message[1]))
            return bool(statuses) and statuses[-1].phase == "finished"

        wait_until(finished, 10, "the server's finished status")
    finally:
        watcher.stop()
    assert [len(m.accepted) for m in fed.metrics()] == [4, 4]
    training = [(s.round, s.phase) for s in statuses if s.phase == "training"]
    assert training == [(1, "training"), (2, "training")]  # one as each round opened; none per update
    assert statuses[-1].phase == "finished"


@pytest.mark.timeout(120)
def test_the_server_opens_rounds_at_once_not_on_its_next_tick(tmp_path, broker):
    """The first round opens once the agents sent the group key confirm it, and each next one once the round
    before closed (``MqttClient.wake``), not at the server's next tick: with its ticks 10 minutes apart two rounds
    still run; on a tree without these wake-ups the first round waits for that tick and the run does not finish."""
    fed = Federation(tmp_path, broker, rounds=2, agents=2)
    server = Aggregator(load_server_config(fed.layout.server_config))
    server.tick_interval_s = 600.0
    fed.run(server, timeout_s=60)
    assert [sorted(m.accepted) for m in fed.metrics()] == [["agent-01", "agent-02"]] * 2
