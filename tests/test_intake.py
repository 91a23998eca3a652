"""Updates that come one after another are accepted with one write of the round's state (a group commit,
``broker_server.agents.intake``); a write that fails undoes them all, and they are accepted once the disk is
back; a refused update in a batch leaves the others accepted."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest

from broker_server.agents.intake import UpdateIntake
from broker_server.agents.refusals import Refusals
from broker_server.agents.registry import AgentRegistry
from broker_server.config import load_server_config
from broker_server.rounds.disk import DiskWatch
from broker_server.rounds.engine import RoundEngine
from broker_server.watch.prometheus import ServerMetrics
from security.keys import Keyring
from security.replay import ReplayGuard
from tests.fedharness import override_toml
from tests.fixtures import completed, open_round

AGENTS = ["agent-01", "agent-02", "agent-03"]


class Intake:
    """An engine with an open round of three agents and the intake in front of it; ``queued`` says how many more
    messages wait in the daemon's inbox after each update."""

    def __init__(self, config, *, close_rounds: bool = True) -> None:  # noqa: ANN001
        self.close_rounds = close_rounds  # False: a close is only noted, the round stays as it was
        self.engine = RoundEngine(config, replay=ReplayGuard(3600))
        open_round(self.engine)
        self.queued = 0
        self.closed: list[float] = []
        self.metrics: list = []
        self.rejections: Counter[str] = Counter()
        metrics = ServerMetrics(config.metrics)
        refusals = Refusals(self.engine, registry=AgentRegistry(Keyring(), 60.0), counts=self.rejections,
                            prometheus=metrics, pool=False)  # fmt: skip
        self.disk = DiskWatch(lambda: self.engine.state.settled_writes)
        self.intake = UpdateIntake(self.engine, disk=self.disk, refusals=refusals, prometheus=metrics,
                                   clock=lambda: 1.0, waiting=lambda: self.queued > 0,
                                   close=self.close)  # fmt: skip

    def close(self, now: float) -> None:
        self.closed.append(now)
        if self.close_rounds:
            self.metrics.append(self.engine.close(now, model_wire_bytes=0))

    def arrive(self, agent: str, seed: int, *, queued: int) -> None:
        self.queued = queued
        self.intake.add(completed(self.engine, agent, seed=seed))


def test_updates_that_come_one_after_another_are_written_once_and_the_round_closes_after_them(config):
    h = Intake(config, close_rounds=False)
    writes = h.engine.state.writes
    h.arrive("agent-01", 0, queued=2)
    h.arrive("agent-02", 1, queued=1)
    assert h.engine.round_state.accepted == [] and h.engine.state.writes == writes  # held while more wait
    h.arrive("agent-03", 2, queued=0)
    assert h.engine.round_state.accepted == AGENTS
    assert h.engine.state.writes == writes + 1  # one write of the state for the three
    resumed = RoundEngine(config, replay=ReplayGuard(3600))  # as after a kill -9: the checkpoint holds all three
    assert resumed.round_state.accepted == AGENTS
    assert h.closed == [1.0]  # nobody left to wait for


def test_a_threshold_of_k_still_takes_exactly_k_updates_of_a_batch(config):
    override_toml(config.path, strategy={"name": "fedavg", "threshold": 2})
    h = Intake(load_server_config(config.path))
    updates = [completed(h.engine, agent, seed=i) for i, agent in enumerate(AGENTS)]
    h.intake.accept(*updates)  # a batch of three (updates written before a failed write, accepted again)
    assert len(h.closed) == 1 and h.metrics[0].accepted == ["agent-01", "agent-02"]
    assert "agent-03" not in (h.engine.round_state.accepted if h.engine.round_state else [])


def test_the_update_that_completes_the_round_is_accepted_at_once_though_more_messages_wait(config):
    """The agents' statuses keep the daemon's inbox busy at the end of a round: the batch that holds what the round
    waits for goes in at once, and the round closes, not at the next tick (by the round's rule: all, or K)."""
    h = Intake(config)
    h.arrive("agent-01", 0, queued=3)
    h.arrive("agent-02", 1, queued=3)
    assert h.closed == []  # held: agent-03 is waited for
    h.arrive("agent-03", 2, queued=3)
    assert len(h.closed) == 1 and sorted(h.metrics[0].accepted) == AGENTS
    override_toml(config.path, strategy={"name": "fedavg", "threshold": 2})
    h = Intake(load_server_config(config.path))
    h.arrive("agent-01", 0, queued=3)
    h.arrive("agent-02", 1, queued=3)
    assert len(h.closed) == 1 and h.metrics[0].accepted == ["agent-01", "agent-02"]


def test_a_lone_update_is_accepted_at_once_and_flush_accepts_a_held_one(config):
    h = Intake(config)
    h.arrive("agent-01", 0, queued=0)
    assert h.engine.round_state.accepted == ["agent-01"]
    h.arrive("agent-02", 1, queued=5)  # a status waits behind it: the daemon flushes before handling that
    assert h.engine.round_state.accepted == ["agent-01"]
    h.intake.flush()
    assert h.engine.round_state.accepted == ["agent-01", "agent-02"] and h.closed == []


def test_a_refused_update_in_a_batch_leaves_the_others_accepted_and_written(config):
    h = Intake(config)
    bad = completed(h.engine, "agent-02", seed=1)
    bad = dataclasses.replace(bad, data=memoryview(b"not an update"))
    h.queued = 2
    h.intake.add(completed(h.engine, "agent-01", seed=0))
    h.intake.add(bad)
    h.arrive("agent-03", 2, queued=0)
    assert h.engine.round_state.accepted == ["agent-01", "agent-03"]
    assert h.engine.round_state.failed == ["agent-02"] and sum(h.rejections.values()) == 1
    assert RoundEngine(config, replay=ReplayGuard(3600)).round_state.accepted == ["agent-01", "agent-03"]


def test_a_batch_whose_write_fails_is_undone_whole_and_accepted_once_the_disk_is_back(config, monkeypatch):
    h = Intake(config)
    store = h.engine.state.store
    real_save = store.save

    def full_disk(checkpoint):  # noqa: ANN001, ANN202
        raise OSError(28, "No space left on device", str(config.state_dir / "checkpoint" / "state.json"))

    monkeypatch.setattr(store, "save", full_disk)
    h.arrive("agent-01", 0, queued=1)
    h.arrive("agent-02", 1, queued=0)
    assert h.engine.round_state.accepted == []  # memory never ahead of the disk
    assert sorted(h.intake.unsaved) == ["agent-01", "agent-02"] and h.disk.problem
    monkeypatch.setattr(store, "save", real_save)
    h.intake.retry()
    assert h.engine.round_state.accepted == ["agent-01", "agent-02"] and not h.intake.unsaved
    assert RoundEngine(config, replay=ReplayGuard(3600)).round_state.accepted == ["agent-01", "agent-02"]


def test_one_write_writes_what_came_before_an_unexpected_error_and_nothing_after_a_disk_error(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    state = engine.state
    writes = state.writes
    with state.one_write():
        state.checkpoint()
        with state.one_write():  # nested: the outer one writes
            state.checkpoint()
        assert state.writes == writes
    assert state.writes == writes + 1
    with pytest.raises(ValueError), state.one_write():
        state.checkpoint()
        raise ValueError("a bug after an accepted update")
    assert state.writes == writes + 2
    with pytest.raises(OSError), state.one_write():
        state.checkpoint()
        raise OSError(5, "I/O error")
    assert state.writes == writes + 2  # left for durably to undo
    state.checkpoint()
    assert state.writes == writes + 3  # outside, a checkpoint is written at once again


def test_a_refusal_in_a_batch_whose_write_fails_is_said_once_after_the_disk_is_back(config, monkeypatch):
    h = Intake(config, close_rounds=False)
    store, real_save = h.engine.state.store, h.engine.state.store.save
    scored: list[str] = []
    monkeypatch.setattr(h.engine, "on_accepted", scored.append)  # scoring and keeping: only once written

    def full_disk(checkpoint):  # noqa: ANN001, ANN202
        raise OSError(28, "No space left on device", "state.json")

    monkeypatch.setattr(store, "save", full_disk)
    bad = dataclasses.replace(completed(h.engine, "agent-01", seed=0), data=memoryview(b"not an update"))
    h.queued = 1
    h.intake.add(bad)
    h.arrive("agent-02", 1, queued=0)
    assert sum(h.rejections.values()) == 0 and scored == []  # undone: nothing said, nothing done
    assert sorted(h.intake.unsaved) == ["agent-01", "agent-02"]
    monkeypatch.setattr(store, "save", real_save)
    h.intake.retry()
    assert sum(h.rejections.values()) == 1 and h.engine.round_state.failed == ["agent-01"]
    assert h.engine.round_state.accepted == ["agent-02"] and scored == ["agent-02"]


def test_a_second_copy_from_one_sender_lets_the_batch_in_first_and_is_refused_once(config):
    h = Intake(config, close_rounds=False)
    h.arrive("agent-01", 0, queued=3)
    h.arrive("agent-01", 0, queued=2)  # its first copy goes in before the second is looked at
    assert h.engine.round_state.accepted == ["agent-01"]
    h.arrive("agent-02", 1, queued=0)
    assert h.engine.round_state.accepted == ["agent-01", "agent-02"] and sum(h.rejections.values()) == 1


def test_an_internal_error_on_one_update_leaves_the_rest_of_its_batch_accepted(config, monkeypatch):
    h = Intake(config, close_rounds=False)
    accept = h.engine.accept

    def buggy(done, now=None):  # noqa: ANN001, ANN202
        if done.manifest.sender == "agent-02":
            raise RuntimeError("a bug")
        return accept(done, now)

    monkeypatch.setattr(h.engine, "accept", buggy)
    h.arrive("agent-01", 0, queued=2)
    h.arrive("agent-02", 1, queued=1)
    h.arrive("agent-03", 2, queued=0)
    assert h.engine.round_state.accepted == ["agent-01", "agent-03"]


def test_a_status_between_updates_keeps_their_batch_open_and_one_that_changes_the_round_lets_it_in(tmp_path):
    """At 1,000 agents the statuses between uploads made nearly every update a write of its own (2,267 writes in
    a 3-round run of 3,000 updates). A status that changes nothing of the round leaves the batch open while more
    messages wait; a training given up closes it first, so the round sees the updates that came before it; and
    with nothing more waiting, a status lets the batch in (nothing to batch it with)."""
    from broker_server.daemon import Aggregator
    from protocol.messages import AgentStatus
    from security.keys import Identity
    from security.signing import signed_payload
    from sim.federation import SimSettings, create_federation

    layout = create_federation(tmp_path, SimSettings(agents=5, rounds=2, federation="it"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 5, "quorum": 5})
    server = Aggregator(load_server_config(layout.server_config))
    server.engine.begin_round(list(layout.agent_configs), now=0.0)  # five: the round stays open throughout
    server.engine.announce(now=0.0)
    rs = server.engine.round_state

    def status(agent: str, state: str) -> bytes:
        identity = Identity.load(layout.agent_configs[agent].parent / f"{agent}.key")
        body = AgentStatus(agent=agent, state=state, round=rs.round, samples=9, version=server.engine.version,
                           updated_at=time.time(), run_id=server.engine.run_id)  # fmt: skip
        return signed_payload(body.to_dict(), identity)

    server.mqtt.inbox.put(("more", b""))  # messages wait: an update is held for the batch
    writes = server.engine.state.writes
    server.intake.add(completed(server.engine, "agent-01", seed=1))
    server.handle(server.topics.agent_status("agent-02"), status("agent-02", "training"))
    assert server.engine.state.writes == writes and rs.accepted == []  # still one batch
    server.intake.add(completed(server.engine, "agent-02", seed=2))
    server.handle(server.topics.agent_status("agent-03"), status("agent-03", "failed"))
    assert sorted(rs.accepted) == ["agent-01", "agent-02"] and rs.pending == ["agent-04", "agent-05"]
    assert server.engine.state.writes - writes == 2  # the batch of two, then the excuse
    server.intake.add(completed(server.engine, "agent-04", seed=4))
    assert "agent-04" not in rs.accepted  # held: messages still wait
    server.mqtt.inbox.get_nowait()
    server.handle(server.topics.agent_status("agent-05"), status("agent-05", "training"))
    assert "agent-04" in rs.accepted  # the inbox is empty: in at once, not at the next tick
