"""``state.json`` as the checkpoint writes it, each growing part's items encoded once
(``broker_server.rounds.state_text``): the same JSON as encoding the whole state, write after write."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from broker_server.rounds.checkpoint import Checkpoint, CheckpointStore
from broker_server.rounds.state_text import StateText
from flcore.rounds import RoundState, UpdateRecord


def record(agent: str, **changes: object) -> UpdateRecord:
    fields = {"agent": agent, "samples": 12, "loss": 2.25, "norm": 0.5931725705830051, "wire_bytes": 155752,
              "trained_eval": {"accuracy": 0.5, "loss": 2.26}}  # fmt: skip
    return UpdateRecord(**{**fields, **changes})  # type: ignore[arg-type]


def expected(state: dict, rs: RoundState | None, replay: list[list]) -> dict:
    return {**state, "round_state": rs.to_dict() if rs is not None else None, "replay": replay}


def test_the_text_is_the_state_write_after_write_as_records_come_change_and_go():
    text, state = StateText(), {"format": 2, "run_id": "r1", "pace": {"agent-01": 0.1}, "late": []}
    rs = RoundState(round=3, attempt=1, selected=["agent-01", "agent-02", "agent-03"], deadline=9.5, started_at=1.0)
    rs.updates.append(record("agent-01", folded=0.5))
    replay = [["0ea3", 1796423929.6079378, "agent-01"]]
    assert json.loads(text.encode(state, rs, replay)) == expected(state, rs, replay)
    rs.updates.append(record("agent-02", local_epsilon=1.5, late_from=2, discount=0.5, staleness=1))
    rs.updates[0] = dataclasses.replace(rs.updates[0], folded=0.0)  # a record replaced: its new text, not the kept one
    replay = [*replay[1:], ["77ff", 1796423930.5, "agent-02"], ["0ea4", 1796423931.25, "agent-03"]]
    state = {**state, "pace": {"agent-01": 0.1, "agent-02": 0.2}}
    assert json.loads(text.encode(state, rs, replay)) == expected(state, rs, replay)
    replay = [["77ff", 1796423990.0, "agent-02"], *replay[1:]]  # an id remembered again, later: its own text
    assert json.loads(text.encode(state, rs, replay)) == expected(state, rs, replay)
    rs.updates = [u for u in rs.updates if u.agent != "agent-01"]  # revoked mid-round
    assert json.loads(text.encode(state, rs, [])) == expected(state, rs, [])
    assert json.loads(text.encode(state, None, replay)) == expected(state, None, replay)  # between rounds


def test_an_update_record_cannot_change_once_made():
    """The text of a record is kept by its identity: a record changed in place would keep its old text."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        record("agent-01").folded = 0.0  # type: ignore[misc]


def test_a_saved_checkpoint_loads_back_with_its_round_and_replay_window(tmp_path):
    store = CheckpointStore(tmp_path)
    rs = RoundState(round=2, attempt=1, selected=["agent-01", "agent-02"], deadline=9.5, started_at=1.0)
    rs.updates.extend([record("agent-01"), record("agent-02", folded=0.25)])
    replay = [["0ea3", 1796423929.6079378, "agent-01"], ["77ff", 1796423930.5, "agent-02"]]
    arrays = {"w": np.ones(3, np.float32)}
    store.save(Checkpoint(run_id="r1", next_round=2, model_version=1, global_arrays=arrays, round_state=rs,
                          replay=replay))  # fmt: skip
    loaded = CheckpointStore(tmp_path).load()
    assert loaded is not None and loaded.round_state == rs and loaded.replay == replay
    assert loaded.run_id == "r1" and loaded.next_round == 2 and np.array_equal(loaded.global_arrays["w"], arrays["w"])
