"""Store and forward: an update finished while the link is down is kept on disk and sent once it returns,
across an agent restart and a broker restart; one whose round closed meanwhile is dropped with a reason."""

from __future__ import annotations

import logging
import threading
import time

from security.keys import Identity
from sim.federation import SimSettings, create_federation
from tests.fedharness import Federation, hosted_agent, wait_until
from tests.liveharness import SlowInRound, signed_task


def test_an_update_trained_offline_survives_an_agent_restart_and_is_sent_once_the_broker_returns(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=1, agents=2, strategy={"name": "fedavg"})
    drone = fed.agents[0]
    drone.runner.trainer = SlowInRound(drone.runner.trainer, round_number=1, delay_s=3.0)
    drone_stop = threading.Event()
    fed.threads[0] = threading.Thread(target=drone.run, args=(drone_stop,), daemon=True)
    server, server_thread = fed.start_with_server()
    try:
        wait_until(lambda: drone.state == "training", 60, "the drone to start training")
        broker.stop()  # the link goes down mid-training
        wait_until(lambda: drone.client.progress.last_completed_round == 1, 60, "training to finish offline")
        assert drone.client.progress.sent_round == 0 and drone.client.store.stored_update(1) is not None
        time.sleep(1.0)
        assert drone.client.progress.sent_round == 0  # nothing acknowledged while the broker is gone
        drone_stop.set()
        fed.threads[0].join(10)
        restarted = hosted_agent(fed.layout.agent_configs["agent-01"])  # rebooted while still offline
        restarted_thread = threading.Thread(target=restarted.run, args=(fed.stop,), daemon=True)
        restarted_thread.start()
        time.sleep(1.0)
        broker.start()  # same port, its persisted retained messages back
        server_thread.join(90)
        assert not server_thread.is_alive(), "the round did not finish after the broker came back"
    finally:
        fed.close()
    restarted_thread.join(10)  # its last tick (or its stop) records the broker's acknowledgement
    (round_1,) = fed.metrics()
    assert sorted(round_1.accepted) == ["agent-01", "agent-02"] and round_1.rejected == []  # once, not twice
    assert restarted.client.progress.sent_round == 1


def test_an_unsent_update_whose_round_closed_is_dropped_with_a_reason(tmp_path, caplog):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    server = Identity.load(layout.server_config.parent / "server.key")
    agent = hosted_agent(layout.agent_configs["agent-01"])
    agent._on_task(signed_task(server, round=3, issued_at=time.time()))
    progress = agent.client.progress
    progress.last_completed_round, progress.sent_round = 3, 2  # round 3 trained, never acknowledged
    agent.client.store.store_update(3, b"an update the server never got")
    agent._on_task(signed_task(server, round=4, issued_at=time.time(), model_version=4))
    caplog.set_level(logging.WARNING)
    agent._step()
    assert agent.client.store.stored_update(3) is None and agent.client.progress.sent_round == 3
    assert "update dropped round=3 reason=round 3 closed before its update reached the server" in caplog.text
    agent._step()
    assert caplog.text.count("update dropped") == 1
