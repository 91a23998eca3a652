"""A server whose state went back in time (a restored backup; a second server on the folder) catches up with
its fleet by itself (issue 21, item 2), and a rogue agent's claims cannot move it."""

from __future__ import annotations

import logging
import shutil
import threading
import time

from broker_server.catch_up import agreeing_agents, catch_up
from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from protocol.messages import AgentStatus
from tests.fedharness import Federation, override_toml, wait_until


def status(agent: str, round_number: int, version: int, run_id: str = "run", state: str = "idle") -> AgentStatus:
    return AgentStatus(agent=agent, state=state, round=round_number, samples=1, version=version,
                       updated_at=time.time(), run_id=run_id)  # fmt: skip


def test_only_enough_agreeing_agents_move_the_server_and_only_as_far_as_they_agree():
    def jump(*statuses: AgentStatus, agreeing: int = 2):  # noqa: ANN202
        return catch_up(statuses, run_id="run", held_round=1, version=2, agreeing=agreeing)

    rogue = status("rogue", 10**9, 10**9)
    assert jump(rogue) is None  # one agent, whatever it claims, moves nothing
    assert jump(rogue, status("a", 1, 2)) is None  # the other one is not ahead
    assert jump(rogue, status("b", 5, 6, run_id="older-run")) is None  # another run's rounds say nothing
    assert jump(rogue, status("c", 5, 6, state="offline")) is None
    agreed = jump(rogue, status("a", 3, 4))
    assert (agreed.next_round, agreed.version, agreed.held_round) == (4, 5, 3)  # the 2nd-highest claim, not 10**9
    assert agreed.agents == ["a", "rogue"]
    assert jump(status("a", 3, 1), status("b", 3, 1)).version == 2  # a model version is never moved back
    assert agreeing_agents(quorum=3, enrolled=10) == 3 and agreeing_agents(quorum=1, enrolled=10) == 2
    assert agreeing_agents(quorum=1, enrolled=1) == 1  # a fleet of one is believed


def run_server(fed: Federation, rounds: int) -> Aggregator:
    override_toml(fed.layout.server_config, server={"rounds": rounds})
    server = Aggregator(load_server_config(fed.layout.server_config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    thread.join(90)
    assert not thread.is_alive(), f"the server did not finish its {rounds} rounds"
    return server


def test_a_server_resumed_from_an_older_state_jumps_past_the_rounds_its_agents_hold(tmp_path, broker, caplog):
    caplog.set_level(logging.WARNING)
    fed = Federation(tmp_path, broker, rounds=1, agents=2)
    override_toml(fed.layout.server_config, rounds={"min_agents": 2, "quorum": 2})
    state = fed.server_state
    fed.start_agents()
    try:
        run_server(fed, rounds=1)
        shutil.copytree(state, tmp_path / "backup")  # the state after round 1
        run_server(fed, rounds=3)  # rounds 2 and 3: the agents now hold round 3 and model version 4
        wait_until(lambda: all(a.task.round == 3 and max(a.models) == 4 for a in fed.agents), 30, "round 3 held")
        shutil.rmtree(state)
        shutil.copytree(tmp_path / "backup", state)  # back in time: next round 2, model version 2
        server = run_server(fed, rounds=5)
    finally:
        fed.close()
    assert [m.round for m in fed.metrics()] == [1, 4, 5]
    assert [sorted(m.accepted) for m in fed.metrics()[1:]] == [["agent-01", "agent-02"]] * 2
    assert server.engine.version >= 6  # past what the agents said they hold (their status may lag), +1 per round
    said = [r.getMessage() for r in caplog.records if "state behind the fleet" in r.getMessage()]
    assert len(said) == 1 and "agents agent-01,agent-02 hold round 3 of this run, this state only round 1" in said[0]
    assert "jumping to round 4 and model version" in said[0] and "(was 2)" in said[0]
