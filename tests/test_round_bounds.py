"""A federation's own history bounds what one round may do (flcore.change_bound, broker_server.rounds.fallback):
a step longer than the recent ones is shortened, a collapsing evaluation is rolled back, a round nobody can
finish is closed, and a model nobody can train on gives way to the one before it."""

import math
import time

import numpy as np
import pytest

from flcore.change_bound import WINDOW, ChangeHistory, collapse, shrink_step
from flcore.screening import screened
from protocol.messages import AgentStatus
from security.signing import signed_payload
from sim.federation import SimSettings
from skyfed.api import run_federation
from tests.fedharness import ServerHarness, wait_until


def test_a_step_is_shortened_to_a_multiple_of_the_recent_steps_and_keeps_its_direction():
    history = ChangeHistory()
    assert history.limit(3.0, clip_bound=2.5) == 2.5  # the first step: the round's clip bound
    for norm in (1.0, 2.0, 4.0):
        history.note(norm)
    assert history.limit(3.0, clip_bound=99.0) == 6.0 and math.isinf(history.limit(0.0, 1.0))
    current, new = np.zeros(4, np.float32), np.array([30.0, 40.0, 0.0, 0.0], np.float32)
    model, norm, factor = shrink_step(new, current, 5.0)
    np.testing.assert_allclose(model, [3.0, 4.0, 0.0, 0.0], rtol=1e-6)
    assert norm == 5.0 and factor == pytest.approx(0.1)
    assert shrink_step(new, current, 100.0)[2] == 1.0
    for _ in range(2 * WINDOW):
        history.note(1.0)
    assert len(history.norms) == WINDOW and ChangeHistory.from_list([1.0, "x", math.inf, 2.0]).norms == [1.0, 2.0]


@pytest.mark.parametrize(
    ("in_force", "candidate", "collapsed"),
    [
        ({"loss": 0.7}, {"loss": 2.2}, True),
        ({"loss": 0.7}, {"loss": 2.0}, False),
        ({"loss": 0.01}, {"loss": 0.04}, False),  # a small loss growing: not a collapse (floor 0.5 nats)
        ({}, {"loss": 50.0}, False),  # nothing evaluated yet: nothing to fall from
        ({"map50": 0.6}, {"map50": 0.1}, True),
        ({"map50": 0.6}, {"map50": 0.3}, False),
        ({"map50": 0.05}, {"map50": 0.0}, False),
        ({"loss": 0.05}, {"loss": math.nan}, True),  # a peer would have kept it, and its NaN as the loss in force
    ],
)
def test_an_evaluation_collapses_when_its_loss_passes_three_times_the_model_in_force(in_force, candidate, collapsed):
    assert bool(collapse(in_force, candidate, 3.0)) == collapsed
    assert collapse(in_force, candidate, 0.0) == ""


def test_a_step_far_longer_than_the_federation_ever_took_is_shortened_not_committed_as_sent(tmp_path, broker):
    with ServerHarness(tmp_path, broker, agents=2, rounds=2) as h:
        h.announce_agents()
        for agent, seed in zip(h.agents, (1, 2), strict=True):
            h.send(agent, h.random_delta(seed))
        first = h.wait_metrics(1)
        wait_until(lambda: h.tasks[-1].round == 2, what="round 2 task")
        before = h.server.engine.global_vector.copy()
        for agent, seed in zip(h.agents, (3, 4), strict=True):  # both agents: the round's clip bound follows them
            scaled = {k: np.abs(v) if k.endswith("running_var") else v for k, v in h.random_delta(seed, 100).items()}
            h.send(agent, scaled, round_number=2)
        second = h.wait_metrics(2)
        h.final_model()
        after = h.server.engine.global_vector
    assert first.outcome == second.outcome == "committed" and "change_shrunk" not in first.aggregation
    limit = 3.0 * first.aggregation["change_norm"]
    assert second.aggregation["change_bound"] == pytest.approx(limit, rel=1e-5)
    assert second.aggregation["change_shrunk"] < 0.05
    assert float(np.linalg.norm(after - before)) == pytest.approx(limit, rel=1e-3)


def test_a_round_nobody_can_finish_is_closed_and_a_model_nobody_can_train_on_falls_back(tmp_path, broker):
    """Every update non-finite: before, the round was re-announced to no pending agent at every deadline."""
    with ServerHarness(tmp_path, broker, agents=2, rounds=3, round_rules={"deadline_s": 2.0}) as h:
        h.announce_agents()
        for agent, seed in zip(h.agents, (1, 2), strict=True):
            h.send(agent, h.random_delta(seed))
        assert h.wait_metrics(1).outcome == "committed"
        wait_until(lambda: h.tasks[-1].round == 2, what="round 2 task")
        broken = {k: np.full_like(v, np.nan) for k, v in h.random_delta(3).items()}
        for agent in h.agents:
            h.send(agent, broken, round_number=2)
        second = h.wait_metrics(2)
        task = wait_until(lambda: h.tasks[-1].round == 3 and h.tasks[-1], what="round 3 task")
        in_force = {k: v.copy() for k, v in h.server.engine.global_arrays.items()}
    assert second.outcome == "rolled-back" and second.reason.startswith("stuck: 0 of 2 updates")
    assert "non-finite-values" in second.reason and "back to version 1 as 3" in second.reason
    assert sorted(second.offenders) == sorted(h.agents)
    assert task.model_version == 3 and [t.attempt for t in h.tasks if t.round == 2] == [1]  # never re-announced
    assert all(np.array_equal(in_force[k], v) for k, v in h.initial.items())  # version 1, bit for bit


@pytest.mark.parametrize(
    ("losses", "dropped"),
    [
        ([0.9, 0.95, 3.0], {2}),  # the step that raises the loss is left out
        ([0.9, 1.005, 0.95], set()),  # within 1 % of the model in force's loss
        ([1.5, 1.2, 3.0, 0.9], {2}),  # at most (n - 1) // 2: one of four, the worst
        ([1.5, 1.2, 3.0, 0.9, 2.0], {2, 4}),  # two of five
        ([1.5, 3.0], set()),  # two updates, both raising the loss: both kept (nothing to prefer)
        ([0.9, 3.0], {1}),  # two updates, one good: the other is left out
    ],
)
def test_a_small_rounds_update_that_raises_the_validation_loss_is_left_out(losses, dropped):
    out = screened({"loss": 1.0}, [{"loss": loss} for loss in losses])
    assert set(out) == dropped and all(why.startswith("raises-validation-loss") for why in out.values())
    assert screened({"accuracy": 0.5}, [{"accuracy": 0.1}] * 3) == {}  # no loss to compare: nothing is left out


def test_a_rogue_of_three_sending_its_step_reversed_and_boosted_is_screened_out(tmp_path, broker):
    """Over the real broker and daemons: before the federation's own bounds, this rogue took the loss to
    1.5e11 in four committed rounds, after which every honest update was non-finite."""
    address, attack = f"{broker.host}:{broker.port}", "scale:-20+samples:1000000000000"
    common = {"agents": 3, "rounds": 6, "broker": address, "echo": None}
    clean = run_federation(out=tmp_path / "clean", federation="clean", **common)
    rogue = run_federation(out=tmp_path / "rogue", federation="rogue", attackers=1, attack=attack, **common)
    assert [m.outcome for m in rogue.metrics] == ["committed"] * 6
    attacker = SimSettings(agents=3, attackers=1, attack=attack).attacker_names()
    screened_out = [sorted(m.aggregation.get("screened", {})) for m in rogue.metrics]
    assert sum(s == attacker for s in screened_out) >= 4, screened_out
    assert rogue.final_eval["accuracy"] >= clean.final_eval["accuracy"] - 0.10
    assert all(m.duration_s < 60 for m in rogue.metrics)  # no round waited out its deadline


def _first_round_of_three(h: ServerHarness) -> None:
    h.announce_agents()
    for agent, seed in zip(h.agents, (1, 2, 3), strict=True):
        h.send(agent, h.random_delta(seed))
    assert h.wait_metrics(1).outcome == "committed"
    wait_until(lambda: h.tasks[-1].round == 2, what="round 2 task")


def test_a_rogues_malformed_update_does_not_keep_a_broken_model_in_force(tmp_path, broker):
    """Both honest updates non-finite, the rogue's refused for another reason: with "every refusal non-finite"
    the rogue vetoed the fallback (found by a red-team review); a majority of the selected agents decides."""
    with ServerHarness(tmp_path, broker, agents=3, rounds=3, round_rules={"deadline_s": 2.0}) as h:
        _first_round_of_three(h)
        honest, rogue = list(h.agents)[:2], list(h.agents)[2]
        for agent in honest:
            h.send(agent, {k: np.full_like(v, np.nan) for k, v in h.random_delta(4).items()}, round_number=2)
        h.send(rogue, dict(list(h.random_delta(5).items())[1:]), round_number=2)  # one tensor left out
        second = h.wait_metrics(2)
    assert second.outcome == "rolled-back" and second.reason.startswith("stuck")
    assert "back to version 1 as 3" in second.reason


def test_a_rogues_nan_alone_does_not_roll_the_federation_back(tmp_path, broker):
    """The honest agents report their training failed (excused); only the rogue's update is non-finite: one
    agent's word is no evidence that the model in force is broken."""
    with ServerHarness(tmp_path, broker, agents=3, rounds=3, round_rules={"deadline_s": 2.0}) as h:
        _first_round_of_three(h)
        honest, rogue = list(h.agents)[:2], list(h.agents)[2]
        committed = h.server.engine.global_vector.copy()
        for agent in honest:
            status = AgentStatus(agent=agent, state="failed", round=2, samples=100, version=2, updated_at=time.time(),
                                 group_key_id=h.server.group_keys.key.key_id, detail="training failed: out of memory")
            h.driver.publish(h.topics.agent_status(agent), signed_payload(status.to_dict(), h.agents[agent]),
                             retain=True)  # fmt: skip
        h.send(rogue, {k: np.full_like(v, np.nan) for k, v in h.random_delta(4).items()}, round_number=2)
        second = h.wait_metrics(2)
        wait_until(lambda: h.tasks[-1].round == 3, what="round 3 task")
        now = h.server.engine.global_vector.copy()
    assert second.outcome == "rolled-back" and "back to version" not in second.reason
    assert np.array_equal(now, committed)
