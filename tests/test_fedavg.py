"""FedAvg against a direct numpy computation, and its streaming memory behaviour."""

import numpy as np
import pytest

from broker_server.strategies import AcceptedUpdate, build_strategy
from broker_server.strategies.fedavg import FedAvg


def _updates(rng, n, size):
    return [
        AcceptedUpdate(agent=f"a{i}", delta=rng.standard_normal(size).astype(np.float32), samples=int(s), loss=0.1)
        for i, s in enumerate(rng.integers(1, 500, n))
    ]


def test_fedavg_equals_sample_weighted_mean_of_deltas():
    rng = np.random.default_rng(0)
    global_vector = rng.standard_normal(1000).astype(np.float32)
    updates = _updates(rng, 7, 1000)
    strategy = FedAvg()
    strategy.begin(global_vector)
    for u in updates:
        strategy.accumulate(u)
    result = strategy.finalize().global_vector
    weights = np.array([u.samples for u in updates], np.float64)
    expected = global_vector + np.average(np.stack([u.delta for u in updates]), axis=0, weights=weights)
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)


def test_uniform_weighting_ignores_sample_counts():
    rng = np.random.default_rng(1)
    global_vector = np.zeros(50, np.float32)
    updates = _updates(rng, 3, 50)
    strategy = build_strategy("fedavg", weighting="uniform")
    strategy.begin(global_vector)
    for u in updates:
        strategy.accumulate(u)
    expected = np.mean(np.stack([u.delta for u in updates]), axis=0)
    np.testing.assert_allclose(strategy.finalize().global_vector, expected, rtol=1e-5, atol=1e-6)


def test_state_and_restore_continue_a_round_exactly():
    rng = np.random.default_rng(2)
    global_vector = rng.standard_normal(200).astype(np.float32)
    updates = _updates(rng, 4, 200)
    full = FedAvg()
    full.begin(global_vector)
    for u in updates:
        full.accumulate(u)
    first = FedAvg()
    first.begin(global_vector)
    for u in updates[:2]:
        first.accumulate(u)
    resumed = FedAvg()
    resumed.restore(global_vector, {k: v.copy() for k, v in first.state().items()})
    for u in updates[2:]:
        resumed.accumulate(u)
    np.testing.assert_array_equal(resumed.finalize().global_vector, full.finalize().global_vector)


def test_accumulator_does_not_grow_with_the_number_of_updates():
    rng = np.random.default_rng(3)
    strategy = FedAvg()
    strategy.begin(np.zeros(10_000, np.float32))
    sizes = set()
    for u in _updates(rng, 30, 10_000):
        strategy.accumulate(u)
        sizes.add(sum(a.nbytes for a in strategy.state().values()))
    assert len(sizes) == 1


def test_round_without_updates_keeps_the_global_model():
    g = np.arange(5, dtype=np.float32)
    strategy = FedAvg()
    strategy.begin(g)
    np.testing.assert_array_equal(strategy.finalize().global_vector, g)


def test_unknown_strategy_and_weighting_are_refused_with_the_key():
    with pytest.raises(ValueError, match="strategy.name"):
        build_strategy("fedmagic")
    with pytest.raises(ValueError, match="strategy.weighting"):
        FedAvg(weighting="objects-ish")
