"""A broker killed mid-round and back within seconds: the round resumes at once.

The broker saves its state every 60 s (as deploy/mosquitto/plain.conf), so a kill -9 loses what it held:
updates it acknowledged to agents but was still passing to the server over a slow link
(``tests.linkproxy``), which the agents count as sent and only the server can miss, and the retained
model. On main the first waited for the round's deadline and the model for ``MODEL_STALL_S``.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from broker_server.agents.model_resend import MODEL_STALL_S
from broker_server.agents.reconnects import ASK_AGAIN_AFTER_S, Reconnects
from sim.broker import LocalBroker, free_port, mosquitto_config, mosquitto_path
from tests.fedharness import Federation, override_toml, wait_until
from tests.linkproxy import LinkProxy
from tests.liveharness import SlowInRound

DEADLINE_S = 40.0
RESUMED_WITHIN_S = 15.0  # after the broker is back; main waited for the deadline (then re-announced)


@pytest.fixture
def forgetful_broker(tmp_path):
    """mosquitto on a free port with the deployed autosave interval: a kill loses what it held since."""
    if mosquitto_path() is None:
        pytest.fail("mosquitto is not installed: apt-get install mosquitto")
    data_dir, port = tmp_path / "broker", free_port()
    data_dir.mkdir()
    conf = data_dir / "mosquitto.conf"
    deployed = mosquitto_config("127.0.0.1", port, data_dir).replace("autosave_interval 1\n", "autosave_interval 60\n")
    assert "autosave_interval 60\n" in deployed
    conf.write_text(deployed)
    broker = LocalBroker("mosquitto", "127.0.0.1", port, data_dir, config_file=conf).start()
    yield broker
    broker.stop()
    print(f"--- broker log (shown by pytest only when the test failed) ---\n{broker.log_tail(50)}")


def test_a_broker_killed_mid_round_and_back_within_seconds_resumes_the_round(tmp_path, forgetful_broker):
    broker = forgetful_broker
    proxy = LinkProxy(broker.host, broker.port)

    def server_behind_a_slow_link(layout) -> None:  # noqa: ANN001
        override_toml(layout.server_config, broker={"port": proxy.port}, rounds={"deadline_s": DEADLINE_S})

    fed = Federation(tmp_path / "fed", broker, rounds=1, agents=2, strategy={"name": "fedavg"},
                     edit=server_behind_a_slow_link)  # fmt: skip
    for agent in fed.agents:
        agent.runner.trainer = SlowInRound(agent.runner.trainer, round_number=1, delay_s=1.0)
    _, server_thread = fed.start_with_server()
    try:
        wait_until(lambda: all(a.state == "training" for a in fed.agents), 60, "both agents to train")
        proxy.hold()  # the server's link stalls: what the broker passes it from now on is in flight
        wait_until(lambda: all(a.client.progress.sent_round == 1 for a in fed.agents), 30,
                   "the broker to take both updates")  # fmt: skip
        broker.kill()
        time.sleep(2.0)
        proxy.release()
        broker.start()  # the same port, within 3 s, holding nothing it had not saved
        back = time.monotonic()
        server_thread.join(RESUMED_WITHIN_S)
        resumed_s = time.monotonic() - back
        assert not server_thread.is_alive(), f"round 1 still open {RESUMED_WITHIN_S:.0f} s after the broker was back"
    finally:
        fed.close()
        proxy.close()
    (round_1,) = fed.metrics()
    assert sorted(round_1.accepted) == ["agent-01", "agent-02"] and round_1.missed == [] and round_1.rejected == []
    print(f"round 1 closed {resumed_s:.1f} s after the broker was back (duration_s={round_1.duration_s:.1f})")


def test_a_broker_restart_while_agents_train_sends_each_update_once(tmp_path, forgetful_broker, caplog):
    """The round asked again while the agents still train: the updates they then send answer that newer
    attempt, so none is sent twice (and refused as a duplicate)."""
    caplog.set_level(logging.INFO, logger="skyfed.agent")
    broker = forgetful_broker
    fed = Federation(tmp_path / "fed", broker, rounds=2, agents=2, strategy={"name": "fedavg"})
    asked_again = threading.Event()  # the trainings go on only once the test saw them still train then
    for agent in fed.agents:
        agent.runner.trainer = SlowInRound(agent.runner.trainer, round_number=1, until=asked_again.is_set)
    server, server_thread = fed.start_with_server()
    try:
        wait_until(lambda: all(a.state == "training" for a in fed.agents), 60, "both agents to train")
        broker.kill()
        time.sleep(1.0)
        broker.start()
        wait_until(lambda: all(a.task.attempt == 2 for a in fed.agents), 20, "the round asked again")
        assert all(a.state == "training" for a in fed.agents)
        asked_again.set()
        server_thread.join(40)
        assert not server_thread.is_alive(), "the rounds did not finish"
    finally:
        asked_again.set()  # a failed wait above must not hold the trainings for SlowInRound's 120 s
        fed.close()
    assert [sorted(m.accepted) for m in fed.metrics()] == [["agent-01", "agent-02"]] * 2
    assert [m.rejected for m in fed.metrics()] == [[], []]  # no update refused, as a duplicate or otherwise
    # nothing else refused either: the statuses the dead broker left unacknowledged, which paho re-sends, are no
    # longer overtaken by the new connection's (agent.edge_node; they were, refused as older, in 1 run of 12)
    assert not server.rejections
    assert "re-sending stored update" not in caplog.text


def test_a_model_the_broker_lost_with_its_state_is_published_again_at_once(tmp_path, forgetful_broker):
    """Round 2's model goes out while agent-01's link stalls; the broker dies holding it (unsaved) and comes
    back empty. The server sees its session gone and publishes the model again at once, instead of after
    agent-01 reported waiting for it for ``MODEL_STALL_S`` (main: 17.6 s after the broker was back)."""
    broker = forgetful_broker
    proxy = LinkProxy(broker.host, broker.port)

    def agent_01_behind_a_slow_link(layout) -> None:  # noqa: ANN001
        override_toml(layout.agent_configs["agent-01"], broker={"port": proxy.port})
        override_toml(layout.server_config, rounds={"deadline_s": DEADLINE_S})

    fed = Federation(tmp_path / "fed", broker, rounds=2, agents=2, strategy={"name": "fedavg"},
                     edit=agent_01_behind_a_slow_link)  # fmt: skip
    behind, late = fed.agents[0], fed.agents[1]
    late.runner.trainer = SlowInRound(late.runner.trainer, round_number=1, delay_s=2.0)
    _, server_thread = fed.start_with_server()
    try:
        wait_until(lambda: behind.state == "done" and late.state == "training", 60, "agent-01 done, agent-02 training")
        proxy.hold()
        wait_until(lambda: 2 in late.models, 30, "model version 2 to reach agent-02")
        broker.kill()
        time.sleep(1.0)
        proxy.release()
        broker.start()
        back = time.monotonic()
        within_s = MODEL_STALL_S * 2 / 3
        server_thread.join(within_s)
        assert not server_thread.is_alive(), f"round 2 still open {within_s:.0f} s after the broker was back"
        print(f"round 2 closed {time.monotonic() - back:.1f} s after the broker was back")
    finally:
        fed.close()
        proxy.close()
    assert [sorted(m.accepted) for m in fed.metrics()] == [["agent-01", "agent-02"]] * 2


def test_a_reconnect_not_the_first_connect_republishes_then_asks_again_after_a_pause():
    now = [0.0]
    reconnects = Reconnects(clock=lambda: now[0])
    reconnects.connected()
    assert reconnects.due() == ""  # the first connect: the server published everything at start
    reconnects.connected()
    assert [reconnects.due(), reconnects.due()] == ["reconnected", ""]
    now[0] = ASK_AGAIN_AFTER_S - 0.1
    assert reconnects.due() == ""  # what agents re-send by themselves on reconnecting arrives first
    now[0] = ASK_AGAIN_AFTER_S
    assert [reconnects.due(), reconnects.due()] == ["ask-again", ""]
