"""The swap schedule as a layer over any aggregation, and runs that always end on a published model."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from broker_server.rounds.accept import check_gates
from flcore.rounds import RoundState
from flcore.strategies import build_strategy
from flcore.strategies.base import Contribution
from flcore.update import NotForThisRound
from models.serialization import load_file
from models.weights import to_arrays
from models.zoo import build_model
from sim.federation import SimSettings
from sim.run import run_sim
from sim.sweep import final_accuracy

RNG = np.random.default_rng(7)
GLOBAL = RNG.normal(size=50).astype(np.float32)
MODELS = [GLOBAL + RNG.normal(scale=0.1, size=50).astype(np.float32) for _ in range(5)]
MODELS[4] = GLOBAL + np.float32(40.0)  # one agent's model far from everyone's


def contributions(samples=(10, 20, 30, 40, 50)) -> list[Contribution]:
    """Round contributions as a model-keeping strategy sees them (``model`` set; the delta is this round's)."""
    return [Contribution(f"a{i}", np.zeros(50, np.float32), float(s), 1.0, 0.0, model=m)
            for i, (s, m) in enumerate(zip(samples, MODELS, strict=True))]  # fmt: skip


def average(table: dict) -> np.ndarray:
    strategy = build_strategy({"name": "simfedswap", **table})
    strategy.begin(GLOBAL, ())
    return strategy.aggregate(GLOBAL, contributions()).global_vector


def test_the_default_average_is_the_thesis_weighted_average_of_the_models():
    weights = np.array([10, 20, 30, 40, 50], float)
    expected = sum(w * m.astype(np.float64) for w, m in zip(weights, MODELS, strict=True)) / weights.sum()
    np.testing.assert_allclose(average({}), expected, rtol=1e-5, atol=1e-5)
    uniform = np.mean(np.array(MODELS, np.float64), axis=0)
    np.testing.assert_allclose(average({"weighting": "uniform"}), uniform, rtol=1e-5, atol=1e-5)


def test_median_and_krum_average_rounds_leave_the_far_model_out():
    np.testing.assert_allclose(average({"aggregate": "median"}), np.median(np.array(MODELS), axis=0), atol=1e-6)
    krum = average({"aggregate": "krum", "aggregate_options": {"f": 1, "keep": 1}})
    assert any(np.allclose(krum, m, atol=1e-6) for m in MODELS[:4])  # one of the four close models, whole
    assert np.abs(average({}) - GLOBAL).max() > 10  # plain FedAvg is dragged 40·50/150 off by the far one


def test_a_bad_aggregation_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="strategy.aggregate 'fedswap' must be one of fedavg, krum"):
        build_strategy({"name": "fedswap", "aggregate": "fedswap"})
    with pytest.raises(ValueError, match="strategy.aggregate_options.g is not a known key"):
        build_strategy({"name": "fedswap", "aggregate": "krum", "aggregate_options": {"g": 1}})


def test_the_last_round_of_a_run_is_an_average_whatever_h1_and_h2():
    strategy = build_strategy({"name": "simfedswap"})  # h1 = 5, h2 = 3: a cycle of 15 rounds
    strategy.last_round = 4
    assert [strategy.action(t) for t in range(1, 5)] == ["local", "local", "local", "average"]
    assert "round 4 averages early" in strategy.run_warnings(4)[0]
    strategy.last_round = 0  # a run with no end follows the schedule
    assert strategy.action(4) == "local" and strategy.run_warnings(30) == []


def test_a_short_swapping_run_saves_a_trained_model_and_reports_its_accuracy(tmp_path):
    """The case that was reported: 4 rounds of simfedswap at h1 = 5, h2 = 3 saved the untrained initial weights and
    printed the accuracy of the mean of the agents' models. Now round 4 averages, the saved model is the
    trained average, and the final evaluation the sim reports is the saved model's."""
    settings = SimSettings(agents=4, rounds=4, model="mlp_digits", partition="iid", epochs=1, in_process=True,
                           strategy={"name": "simfedswap"})  # fmt: skip
    result = run_sim(settings, tmp_path / "run", echo=lambda _line: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["action"] for r in rows] == ["local", "local", "local", "average"]
    assert rows[-1]["model_version"] == 2 and result.final_eval == rows[-1]["eval"]
    assert result.final_eval["accuracy"] > 0.5  # the initial model scores ~0.1 on 10 classes
    saved, _ = load_file(tmp_path / "run" / "global_model.safetensors")
    torch.manual_seed(settings.seed)  # the engine's initial model, as it builds it
    initial = to_arrays(build_model("mlp_digits"))
    assert any(not np.array_equal(saved[k], initial[k]) for k in initial)
    assert final_accuracy(tmp_path / "run") == result.final_eval["accuracy"]  # the saved file, evaluated again


def test_an_update_for_a_local_round_is_refused_before_any_memory_is_held_for_it():
    """A rogue (or outdated) agent that uploads in a local round is refused at the transfer's first chunk."""
    state = RoundState(round=3, attempt=1, selected=["a"], deadline=0.0, started_at=0.0, action="local")
    with pytest.raises(NotForThisRound, match="not-expected: round 3 is a local round"):
        check_gates(state, "a", 3, 4)
    check_gates(replace(state, action="swap"), "a", 3, 4)  # the same update in a swap round is expected


def test_under_dp_a_server_optimizer_steps_after_the_noise_not_before():
    """``average`` (what DP noises) is the plain mean of the models; ``server_step`` then applies FedAvgM's
    momentum to whatever it is given (the noisy mean), as for a plain round."""
    strategy = build_strategy({"name": "fedswap", "aggregate": "fedavgm", "weighting": "uniform",
                               "aggregate_options": {"server_lr": 2.0}})  # fmt: skip
    strategy.begin(GLOBAL, ())
    averaged = strategy.average(GLOBAL, contributions())
    np.testing.assert_allclose(averaged.global_vector, np.mean(np.array(MODELS, np.float64), axis=0), atol=1e-5)
    stepped = strategy.server_step(GLOBAL, averaged).global_vector
    np.testing.assert_allclose(stepped - GLOBAL, 2.0 * (averaged.global_vector - GLOBAL), rtol=1e-5, atol=1e-5)
