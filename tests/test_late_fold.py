"""A late update of the round before folded into the next one with its staleness discount (``flcore.late``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from broker_server.rounds.engine import RoundEngine
from flcore.bounds import InfluencePolicy
from flcore.late import DEFAULT_LATE_WEIGHT
from flcore.update import NotForThisRound, UpdateMeta, UpdateRejected
from models.serialization import dumps
from models.weights import float_part
from security.replay import ReplayGuard
from tests.fixtures import completed, open_round, random_delta

PLAIN = InfluencePolicy(clip="off", sample_multiple=0, change_multiple=0, collapse_ratio=0, screen_below=0)


def threshold_engine(config, **strategy) -> RoundEngine:
    """FedAvg closing each round at its 2nd update of 3, bounds off so the numbers are plain weighted means."""
    table = {"name": "fedavg", "threshold": 2, **strategy}
    return RoundEngine(dataclasses.replace(config, strategy=table, bounds=PLAIN), replay=ReplayGuard(3600))


def first_round_leaves_agent_03_late(engine: RoundEngine):
    """Round 1 closes at its threshold on agent-01 and agent-02; agent-03's update of round 1 comes after."""
    open_round(engine)
    late = completed(engine, "agent-03", seed=3, samples=300)  # built on version 1, for round 1
    for i, agent in enumerate(["agent-01", "agent-02"]):
        engine.accept(completed(engine, agent, seed=i, samples=100))
    assert engine.decide(now=0.5) == "close"
    engine.close(now=1.0, model_wire_bytes=0)
    return late


def test_a_late_update_is_folded_into_the_next_round_with_its_discount(config):
    engine = threshold_engine(config)
    late = first_round_leaves_agent_03_late(engine)
    assert engine.version == 2 and engine.state.late.owed == ("agent-03",)
    assert engine.late.held_for_next_round("agent-03", 1)  # between the rounds the daemon holds it
    v2 = float_part(engine.global_arrays)
    open_round(engine)
    record = engine.accept(late)
    assert record.late_from == 1 and record.discount == DEFAULT_LATE_WEIGHT == pytest.approx((1 + 1) ** -0.5)
    assert engine.round_state.delivered == 0  # a late update never counts towards this round's threshold
    on_time = {"agent-01": (11, 100), "agent-02": (12, 200)}
    for agent, (seed, samples) in on_time.items():
        engine.accept(completed(engine, agent, seed=seed, samples=samples))
    metrics = engine.close(now=2.0, model_wire_bytes=0)
    assert metrics.outcome == "committed" and metrics.accepted == ["agent-01", "agent-02"]
    assert metrics.aggregation["folded_late"] == ["agent-03@1"]
    weights = [100, 200, 300 * 2**-0.5]
    deltas = [random_delta(engine, 11), random_delta(engine, 12), random_delta(engine, 3)]
    for name, value in v2.items():
        step = sum(w * d[name] for w, d in zip(weights, deltas, strict=True)) / sum(weights)
        expected = value.astype(np.float64) + step
        np.testing.assert_allclose(engine.global_arrays[name], expected, atol=1e-6)


def test_a_replayed_forged_or_too_old_late_update_is_still_refused(config):
    engine = threshold_engine(config)
    late = first_round_leaves_agent_03_late(engine)
    open_round(engine)
    tampered = dataclasses.replace(late, data=memoryview(bytes(late.data)[:-8] + b"\xff" * 8))
    with pytest.raises(UpdateRejected, match="non-finite"):  # the values are checked as an on-time update's
        engine.accept(tampered)
    meta = UpdateMeta(round=1, base_version=2, samples=100, loss=0.3)  # round 1 was announced with version 1
    data = dumps(random_delta(engine, 4), metadata=meta.to_metadata())
    with pytest.raises(UpdateRejected, match="version"):
        engine.accept(dataclasses.replace(late, data=memoryview(data), wire_bytes=len(data)))
    not_owed = dataclasses.replace(late, manifest=dataclasses.replace(late.manifest, sender="agent-01"))
    with pytest.raises(NotForThisRound, match="late"):  # round 1 counted agent-01 already
        engine.accept(not_owed)
    engine.accept(late)
    with pytest.raises(NotForThisRound, match="duplicate"):
        engine.accept(late)
    for i, agent in enumerate(["agent-01", "agent-02"]):
        engine.accept(completed(engine, agent, seed=20 + i))
    engine.close(now=2.0, model_wire_bytes=0)
    open_round(engine)
    with pytest.raises(NotForThisRound, match="stale: round 1 is 2 rounds behind"):
        engine.accept(late)


def test_the_late_window_survives_a_restart_between_the_rounds(config):
    engine = threshold_engine(config)
    late = first_round_leaves_agent_03_late(engine)
    again = threshold_engine(config)
    open_round(again)
    assert again.accept(late).late_from == 1


def test_late_weight_0_keeps_the_old_rule(config):
    engine = threshold_engine(config, late_weight=0)
    late = first_round_leaves_agent_03_late(engine)
    open_round(engine)
    with pytest.raises(NotForThisRound, match="late: round 1 is closed"):
        engine.accept(late)


def test_late_weight_is_checked_and_refused_where_it_cannot_apply(config):
    with pytest.raises(ValueError, match="strategy.late_weight must be a number in"):
        threshold_engine(config, late_weight=2)
    with pytest.raises(ValueError, match="strategy.late_weight must be 0 with 'simfedswap'"):
        threshold_engine(config, name="simfedswap", late_weight=0.5)
