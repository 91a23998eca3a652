"""Model swapping's ``local`` rounds. A status that says an agent trained the open local round
counts even when the server could not write it at once (the disk full, say): it is the agent's standing word,
read again on every tick. A round continues local training only after a round that really was local.
"""

from __future__ import annotations

import time

from broker_server.agents.publisher import PublishedModel
from broker_server.config import load_server_config
from broker_server.rounds.engine import RoundEngine
from broker_server.rounds.round_task import round_task
from protocol.messages import AgentStatus, RoundTask
from security.replay import ReplayGuard
from security.signing import signed_payload
from sim.federation import SimSettings, create_federation
from tests.fedharness import ServerHarness, override_toml, wait_until
from tests.fixtures import AGENTS, run_round, state_json, update


def say_trained(h: ServerHarness, agent: str, task: RoundTask) -> None:
    """Play ``agent``'s status after it trained ``task``'s local round (nothing uploaded)."""
    status = AgentStatus(agent=agent, state="done", round=task.round, samples=100, version=task.model_version,
                         updated_at=time.time(), group_key_id=h.server.group_keys.key.key_id,
                         last_completed_round=task.round, run_id=task.run_id)  # fmt: skip
    h.driver.publish(h.topics.agent_status(agent), signed_payload(status.to_dict(), h.agents[agent]), retain=True)


def test_a_trained_status_that_could_not_be_written_counts_once_the_disk_is_back(tmp_path, broker):
    with ServerHarness(tmp_path, broker, agents=2, rounds=2, strategy={"name": "fedswap", "h1": 2, "h2": 1}) as h:
        task = h.announce_agents()
        assert task.action == "local" and task.round == 1
        say_trained(h, "agent-01", task)
        wait_until(lambda: state_json(h.config)["round_state"]["trained"] == ["agent-01"], what="agent-01, written")
        checkpoint_dir, aside = h.config.state_dir / "checkpoint", h.config.state_dir / "aside"
        checkpoint_dir.rename(aside)
        checkpoint_dir.write_text("the disk is gone")  # nothing under it can be written
        say_trained(h, "agent-02", task)
        wait_until(lambda: "agent-02 trained locally" in h.server.disk.problem, what="the disk problem")
        assert h.server.engine.round_state.trained == ["agent-01"]  # memory is what the disk holds
        checkpoint_dir.unlink()
        aside.rename(checkpoint_dir)
        metrics = h.wait_metrics(1)  # agent-02 said nothing new: the server read its standing status again
        assert metrics.action == "local" and metrics.accepted == ["agent-01", "agent-02"] and metrics.missed == []
        assert metrics.duration_s < 20  # closed once nobody was waited for, not at the 30 s deadline


def test_a_round_after_an_average_downloads_the_global_model_even_where_the_schedule_said_local(tmp_path):
    """fedswap h1 = 2, h2 = 1 with server.rounds = 1: round 1, the run's last, averages (the schedule said local).
    server.rounds raised to 4 goes on with the run: round 2's agents start from the new global model, which
    they must download (they hold no local rounds' model descending from it), so the task does not say
    ``continues`` and ``bytes_down`` counts the downloads."""
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=1, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3}, bounds={"clip": "off"},
                  strategy={"name": "fedswap", "h1": 2, "h2": 1})  # fmt: skip
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    run_round(engine, seed=0)
    assert engine.close(now=1.0, model_wire_bytes=1000).action == "average" and engine.finished

    override_toml(layout.server_config, server={"rounds": 4})
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=2.0)
    assert engine.round_state.action == "average" and not engine.local.continues()
    published = PublishedModel(engine.version, "ab" * 32, 1, 0)
    task = round_task(engine, published, federation="e", group_key_id="", now=2.0)
    assert not any(start.continues for start in task.starts)
    engine.announce(now=2.0)
    for i, agent in enumerate(AGENTS):
        engine.accept(update(engine, agent, 10 + i)[0])
    assert engine.close(now=3.0, model_wire_bytes=1000).bytes_down == 3000
