"""A late update of the round before folded into the next one with its staleness discount (``flcore.late``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agent.peer.collect import RoundCollector, RoundGuards
from agent.peer.stale import StaleGuard
from broker_server.privacy.policy import PrivacyPolicy
from broker_server.rounds.engine import RoundEngine
from flcore.bounds import InfluencePolicy
from flcore.late import DEFAULT_LATE_WEIGHT
from flcore.strategies import build_strategy
from flcore.update import NotForThisRound, TrainResult, UpdateMeta, UpdateRejected, encode_model
from models.serialization import dumps
from models.weights import NamedArrays, float_part
from models.zoo import initial_model
from security.replay import ReplayGuard
from tests.fixtures import completed, nudged, open_round, peer_task, random_delta

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
    v1 = float_part(engine.global_arrays)
    late = first_round_leaves_agent_03_late(engine)
    assert engine.version == 2 and engine.state.late[-1].owed == ("agent-03",)
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
    late_model = {k: v1[k].astype(np.float64) + d for k, d in random_delta(engine, 3).items()}  # built on version 1
    changes = [random_delta(engine, 11), random_delta(engine, 12), {k: late_model[k] - v2[k] for k in v2}]
    for name, value in v2.items():  # a weighted mean of the three models: v2 + Σ w·change / Σ w
        step = sum(w * d[name] for w, d in zip(weights, changes, strict=True)) / sum(weights)
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
    with pytest.raises(NotForThisRound, match="not-owed"):  # round 1 counted agent-01 already
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


# --- peer mode: a member's late update of the round before, folded into a peer's next round


def test_a_peer_folds_a_members_late_update_at_its_discount_and_refuses_a_replayed_one(tmp_path):
    guard, m1 = StaleGuard("agent-01"), initial_model("digits_cnn", 10, 0)
    models = {name: nudged(m1, seed) for seed, name in enumerate(["agent-01", "agent-02", "agent-03"], start=1)}

    def update(round_number: int, sender: str, arrays: NamedArrays, base: NamedArrays, samples: int) -> bytes:
        return encode_model(peer_task(round_number), base, TrainResult(arrays, samples, 0.1),
                            residual=tmp_path / f"{sender}-{round_number}")  # fmt: skip

    one = RoundCollector(1, m1, PLAIN, "agent-01", guard)
    for name in ("agent-01", "agent-02"):  # threshold 2: round 1 closes without agent-03
        one.accept(name, update(1, name, models[name], m1, 100), 0)
    late = update(1, "agent-03", models["agent-03"], m1, 300)
    replayed = update(1, "agent-02", models["agent-02"], m1, 100)
    m2 = nudged(m1, 9)  # this peer's round-2 model
    two = RoundCollector(2, m2, PLAIN, "agent-01", guard)
    assert two.accept("agent-03", late, 0, DEFAULT_LATE_WEIGHT).record.late_from == 1
    with pytest.raises(UpdateRejected, match="duplicate"):
        two.accept("agent-03", late, 0, DEFAULT_LATE_WEIGHT)
    with pytest.raises(UpdateRejected, match="stale-base: its model is one agent-02 had in round 1, replayed"):
        two.accept("agent-02", replayed, 0, DEFAULT_LATE_WEIGHT)
    own = {"agent-01": (nudged(m2, 11), 100), "agent-02": (nudged(m2, 12), 200)}
    for name, (arrays, samples) in own.items():
        two.accept(name, update(2, name, arrays, m2, samples), 0)
    new, detail = two.aggregate(build_strategy({"name": "fedavg"}), RoundGuards(lambda arrays: {"loss": 1.0}))
    assert two.on_time == ["agent-01", "agent-02"] and detail["folded_late"] == ["agent-03@1"]
    weighted = [(own["agent-01"][0], 100), (own["agent-02"][0], 200), (models["agent-03"], 300 * 2**-0.5)]
    for name in float_part(m2):  # the weighted mean of the three models
        expected = sum(w * arrays[name].astype(np.float64) for arrays, w in weighted) / sum(w for _, w in weighted)
        np.testing.assert_allclose(new[name], expected, atol=1e-6)


def test_under_privacy_late_updates_are_refused_and_asking_for_them_fails_naming_the_key():
    privacy = PrivacyPolicy(clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"strategy.late_weight must be 0 with \[privacy\]"):
        privacy.check_compatible({"name": "fedavg", "weighting": "uniform", "threshold": 2, "late_weight": 0.5},
                                 InfluencePolicy())
    strategy = build_strategy({"name": "fedavg", "threshold": 2})
    assert strategy.late_weight == DEFAULT_LATE_WEIGHT
    privacy.configure(strategy)
    assert strategy.late_weight == 0  # the default with a threshold, off under privacy
