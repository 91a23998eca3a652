"""Agents that never deliver cost a round its deadline once, not every round (issue 21, item 4), and
the refusals that say an agent sent nothing usable end its part in the round at once (item 8)."""

from __future__ import annotations

import pytest

from broker_server.config import load_server_config
from broker_server.engine import RoundEngine
from protocol.update import UpdateMeta, UpdateMetaError
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import ServerHarness, override_toml
from tests.test_engine import completed

AGENTS = ["agent-01", "agent-02", "agent-03"]


@pytest.fixture
def config(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=6, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 2, "quorum": 2, "deadline_s": 20.0})
    return load_server_config(layout.server_config)


def test_an_agent_pending_when_a_quorate_round_closes_at_its_deadline_is_backed_off_across_a_restart(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    assert engine.round_state.selected == AGENTS
    for i, agent in enumerate(AGENTS[:2]):
        engine.accept(completed(engine, agent, seed=i), now=1.0)
    assert engine.decide(now=5.0) == "wait" and engine.decide(now=21.0) == "close"  # it waits for agent-03 once
    engine.close(now=21.0, model_wire_bytes=0)
    restarted = RoundEngine(config, replay=ReplayGuard(3600))  # the back-off is in the checkpoint
    assert restarted.health.backed_off(2) == {"agent-03": 1}
    assert restarted.begin_round(AGENTS, now=30.0).selected == AGENTS[:2]


def test_a_round_closed_early_by_a_threshold_backs_off_nobody(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(AGENTS[:2]):
        engine.accept(completed(engine, agent, seed=i), now=1.0)
    engine.close(now=2.0, model_wire_bytes=0)  # before the deadline: agent-03 was slower, not absent
    assert engine.health.records == {}


def test_an_agent_that_says_its_training_failed_is_not_waited_for_and_is_backed_off(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(AGENTS[:2]):
        engine.accept(completed(engine, agent, seed=i), now=1.0)
    assert not engine.gave_up("agent-03", 7, "reported its training failed")  # another round's status
    assert engine.gave_up("agent-03", 1, "reported its training failed")
    assert not engine.gave_up("agent-03", 1, "reported its training failed")  # counted once
    assert engine.decide(now=2.0) == "close"  # at once, not at the deadline
    metrics = engine.close(now=2.0, model_wire_bytes=0)
    assert metrics.missed == ["agent-03"] and engine.health.backed_off(2) == {"agent-03": 1}


def test_a_deeply_nested_local_eval_is_a_bad_header_not_a_crash():
    meta = UpdateMeta(round=1, base_version=1, samples=10, loss=0.5).to_metadata()
    for depth, why in ((5000, "exceed the limit"), (2000, "nested too deeply")):  # 5000: as the issue measured
        meta["local_eval"] = "[" * depth + "]" * depth
        with pytest.raises(UpdateMetaError, match=f"bad-metadata: .*{why}"):
            UpdateMeta.from_metadata(meta)


def test_an_update_refused_whole_as_too_large_ends_its_senders_part_in_the_round_at_once(tmp_path, broker):
    with ServerHarness(tmp_path, broker, agents=3, round_rules={"quorum": 2, "min_agents": 2}) as h:
        h.announce_agents()
        for agent in ("agent-01", "agent-02"):
            h.publish_update(agent, h.sealed(h.agents[agent], h.update_bytes(h.random_delta(int(agent[-1])))))
        h.publish_update("agent-03", h.sealed(h.agents["agent-03"], bytes(64 << 20))[:1])
        metrics = h.wait_metrics()  # within seconds: the deadline is 30 s away
    assert sorted(metrics.accepted) == ["agent-01", "agent-02"] and metrics.missed == ["agent-03"]
    assert any(r.reason.startswith("too-large") for r in metrics.rejected)
