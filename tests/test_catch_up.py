"""A server whose state went back in time (a restored backup; a second server on the folder) catches up with
its fleet by itself, and a rogue agent's claims cannot move it."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import replace

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from broker_server.rounds.catch_up import catch_up
from protocol.messages import AgentStatus
from security.keys import Identity
from security.signing import receipt_valid, round_receipt
from tests.fedharness import Federation, override_toml, wait_until

SERVER = Identity.generate("server")


def status(agent: str, round_number: int, task_version: int, run_id: str = "run", state: str = "idle", *,
           signed_by: Identity | None = SERVER) -> AgentStatus:  # fmt: skip
    """An agent's status naming the task it holds, with that task's receipt as ``signed_by`` made it."""
    receipt = round_receipt(signed_by, "fed", run_id, round_number, task_version) if signed_by else ""
    return AgentStatus(agent=agent, state=state, round=round_number, samples=1, version=task_version + 1,
                       updated_at=time.time(), run_id=run_id, task_version=task_version, receipt=receipt)  # fmt: skip


def test_only_rounds_the_server_signed_move_it_and_a_rogue_agents_claims_do_not():
    public = SERVER.public

    def jump(*statuses: AgentStatus):  # noqa: ANN202
        def proven(s: AgentStatus) -> bool:
            return receipt_valid(s.receipt, public, "fed", s.run_id, s.round, s.task_version)

        return catch_up(statuses, run_id="run", held_round=1, version=2, proven=proven)

    forged = status("rogue", 10**9, 10**9, signed_by=Identity.generate("server"))  # a key of its own, same name
    unsigned = status("rogue2", 10**9, 10**9, signed_by=None)
    genuine = status("a", 3, 3)
    moved = replace(genuine, agent="rogue3", round=10**9)  # a genuine receipt, claimed for another round
    assert jump(forged, unsigned, moved) is None  # no claim without the server's signature over it counts
    assert jump(status("b", 5, 6, run_id="older-run")) is None  # another run's rounds say nothing
    assert jump(status("c", 5, 6, state="offline")) is None
    assert jump(status("d", 1, 2)) is None  # not ahead
    agreed = jump(forged, unsigned, moved, genuine, status("e", 2, 2))
    assert (agreed.next_round, agreed.version, agreed.held_round) == (4, 5, 3)  # past the genuine round 3 only
    assert agreed.agents == ["a", "e"]
    assert jump(status("a", 3, 0)).version == 2  # a model version is never moved back


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
    assert len(said) == 1 and "hold round 3 of this run, this state only round 1" in said[0]
    assert "jumping to round 4 and model version" in said[0] and "(was 2)" in said[0]
