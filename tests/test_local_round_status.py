"""Model swapping's ``local`` rounds close on the agents' signed statuses (issue 23 review): a status that says an
agent trained the open local round counts even when the server could not write it at once (the disk full, say):
it is the agent's standing word, seen again on every tick, not an event lost with the failed write."""

from __future__ import annotations

import time

from protocol.messages import AgentStatus, RoundTask
from security.signing import signed_payload
from tests.fedharness import ServerHarness, wait_until
from tests.test_disk_failures import state_json


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
