"""A federation's own history bounds what one round may do (flcore.change_bound, broker_server.fallback):
a step longer than the recent ones is shortened, a collapsing evaluation is rolled back, a round nobody can
finish is closed, and a model nobody can train on gives way to the one before it."""

import math

import numpy as np
import pytest

from flcore.change_bound import WINDOW, ChangeHistory, collapse, shrink_step
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
