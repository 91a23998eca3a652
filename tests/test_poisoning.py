"""An enrolled agent gone rogue, over a real broker: it cannot crash the server, brick the federation or
take over the global model (docs/strategies.md, "The safe commit path")."""

import json

import numpy as np

from tests.fedharness import ServerHarness, wait_until


def _norm(delta):
    return float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in delta.values())))


def _assert_model(final, expected):
    assert final.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(final[name], expected[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_a_scaled_update_is_clipped_to_twice_the_median_norm_by_default(tmp_path, broker):
    with ServerHarness(tmp_path, broker, agents=3) as h:
        h.announce_agents()
        scaled = h.random_delta(3, scale=1e6)
        scaled = {k: np.abs(v) if k.endswith("running_var") else v for k, v in scaled.items()}  # stays valid
        deltas = [h.random_delta(1), h.random_delta(2), scaled]
        for agent, delta in zip(h.agents, deltas, strict=True):
            h.send(agent, delta)
        metrics = h.wait_metrics()
        final = h.final_model()
    assert metrics.outcome == "committed" and metrics.aggregation["clipped"] == ["agent-03"]
    norms = [_norm(d) for d in deltas]
    bound = 2 * sorted(norms)[1]
    assert metrics.aggregation["clip_bound"] == pytest_approx(bound)
    _assert_model(final, h.expected_model(deltas, [100] * 3, [min(1.0, bound / n) for n in norms]))


def test_an_inflated_sample_claim_among_three_weighs_at_most_the_median_claim(tmp_path, broker):
    """With twice the median, one claim of three held half the weight (docs/strategies.md, Influence bounds)."""
    with ServerHarness(tmp_path, broker, agents=3) as h:
        h.announce_agents()
        deltas = [h.random_delta(1), h.random_delta(2), h.random_delta(3)]
        for agent, delta, samples in zip(h.agents, deltas, [100, 100, 10**15], strict=True):
            h.send(agent, delta, samples=samples)
        metrics = h.wait_metrics()
        final = h.final_model()
    assert metrics.aggregation["capped"] == ["agent-03"] and metrics.aggregation["sample_cap"] == 100
    _assert_model(final, h.expected_model(deltas, [100, 100, 100]))


def test_an_update_that_would_make_a_running_variance_negative_is_refused(tmp_path, broker):
    """A sign-flipped update negates BatchNorm's running-variance delta; applied, the variance goes
    negative and every evaluation becomes NaN. Honest training never does that, so it is refused."""
    with ServerHarness(tmp_path, broker, agents=2) as h:
        h.announce_agents()
        var = next(name for name in h.initial if name.endswith("running_var"))
        flipped = h.random_delta(9)
        flipped[var] = (-2.0 * h.initial[var]).astype(np.float32)
        h.send("agent-02", flipped)
        h.wait_rejection("invalid-running-var")
        deltas = [h.random_delta(1), h.random_delta(2)]
        for agent, delta in zip(h.agents, deltas, strict=True):
            h.send(agent, delta)
        metrics = h.wait_metrics()
        final = h.final_model()
    assert metrics.outcome == "committed" and any(r.reason.startswith("invalid-running-var") for r in metrics.rejected)
    _assert_model(final, h.expected_model(deltas, [100, 100]))


def test_with_bounds_off_a_poisoned_round_is_rolled_back_and_the_federation_carries_on(tmp_path, broker):
    off = {"clip": "off", "sample_multiple": 0.0, "change_multiple": 0.0, "collapse_ratio": 0.0}
    with ServerHarness(tmp_path, broker, agents=3, rounds=2, bounds=off) as h:
        h.announce_agents()
        h.send("agent-01", h.random_delta(1))
        h.send("agent-02", h.random_delta(2))
        poisoned = {k: np.abs(v) if k.endswith("running_var") else v for k, v in h.random_delta(3, 1e18).items()}
        h.send("agent-03", poisoned)  # finite, running variances positive: validation passes; evaluation is NaN
        first = h.wait_metrics(1)
        assert first.outcome == "rolled-back" and first.reason == "non-finite-evaluation"
        assert first.offenders == ["agent-03"] and first.model_version == 1 and first.eval == {}
        checkpoint = json.loads((h.config.state_dir / "checkpoint" / "state.json").read_text())
        assert checkpoint["model_version"] == 1 and checkpoint["next_round"] == 2
        wait_until(lambda: len(h.tasks) >= 2 and h.tasks[-1].round == 2, what="round 2 task")
        assert h.tasks[-1].model_version == 1  # the agents train on from the kept model
        deltas = [h.random_delta(4), h.random_delta(5), h.random_delta(6)]
        for agent, delta in zip(h.agents, deltas, strict=True):
            h.send(agent, delta, round_number=2)
        second = h.wait_metrics(2)
        final = h.final_model()
    assert second.outcome == "committed" and second.model_version == 2
    assert np.isfinite(second.eval["loss"]) and second.eval["accuracy"] > 0
    _assert_model(final, h.expected_model(deltas, [100] * 3))
    rows = [json.loads(line) for line in (h.config.state_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["outcome"]) for r in rows] == [(1, "rolled-back"), (2, "committed")]


def test_a_change_beyond_max_change_norm_is_rolled_back(tmp_path, broker):
    with ServerHarness(tmp_path, broker, agents=2, bounds={"clip": "off", "max_change_norm": 1e-6}) as h:
        h.announce_agents()
        h.send("agent-01", h.random_delta(1))
        h.send("agent-02", h.random_delta(2))
        metrics = h.wait_metrics()
        h.final_model()
    assert metrics.outcome == "rolled-back" and metrics.reason.startswith("change-too-large")
    assert sorted(metrics.offenders) == ["agent-01", "agent-02"]  # nobody stands out: all are named


def test_an_exception_in_a_step_rolls_the_round_back_and_one_in_the_loop_is_counted_and_survived(tmp_path, broker):
    with ServerHarness(tmp_path, broker, agents=2, rounds=2) as h:
        strategy, registry = h.server.engine.strategy, h.server.registry
        real_aggregate, real_eligible = strategy.aggregate, registry.eligible
        failures = {"tick": 3, "aggregate": 1}

        def flaky(name, real):
            def call(*args):
                if failures[name] > 0:
                    failures[name] -= 1
                    raise RuntimeError("boom")
                return real(*args)

            return call

        registry.eligible = flaky("tick", real_eligible)
        strategy.aggregate = flaky("aggregate", real_aggregate)
        h.announce_agents()
        assert h.server.errors == 3  # three ticks failed, were logged and counted; the loop went on
        h.send("agent-01", h.random_delta(1))
        h.send("agent-02", h.random_delta(2))
        first = h.wait_metrics(1)
        assert first.outcome == "rolled-back" and first.reason == "internal-error in aggregate: RuntimeError: boom"
        wait_until(lambda: h.tasks[-1].round == 2, what="round 2")
        h.send("agent-01", h.random_delta(3), round_number=2)
        h.send("agent-02", h.random_delta(4), round_number=2)
        assert h.wait_metrics(2).outcome == "committed"
        h.final_model()


def pytest_approx(value):
    import pytest

    return pytest.approx(value, rel=1e-5)
