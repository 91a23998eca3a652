"""Strategies against direct numpy computations and small hand-computed cases."""

import math

import numpy as np
import pytest

from flcore.bounds import InfluencePolicy, Tentative, bound_influence, tentative
from flcore.onepass import scan
from flcore.strategies import build_strategy
from flcore.strategies.krum import krum_scores, squared_distances
from flcore.strategies.trimmed_mean import trim_count
from models.weights import TensorSpec
from tests.fixtures import contributions


def test_fedavg_streaming_folds_plus_corrections_equal_the_weighted_mean_of_clipped_deltas():
    rng = np.random.default_rng(0)
    g = rng.standard_normal(2000).astype(np.float32)
    deltas = [rng.standard_normal(2000).astype(np.float32) * s for s in (1, 1.2, 0.8, 5.0, 1.1)]
    samples = [100, 200, 150, 120, 10**9]
    policy = InfluencePolicy()  # adaptive clip 2 x median, samples capped at 2 x median
    fedavg = build_strategy({"name": "fedavg"})
    fedavg.begin(g, ())
    norms, claims, folded = [], [], []
    for d, n in zip(deltas, samples, strict=True):
        fold = fedavg.fold_plan(tentative(policy, np.array(norms), np.array(claims, float), n))
        result = scan(d, fold)
        folded.append(fold.weight if fold is not None and result.folded else 0.0)
        norms.append(result.norm)
        claims.append(n)
    assert folded[:2] == [0.0, 0.0]  # no reference yet: deferred to the end
    influence = bound_influence(policy, np.array(norms), np.array(claims, float))
    assert influence.scales[3] < 1 and influence.samples[4] < samples[4]
    out = fedavg.aggregate(g, contributions(deltas, influence.samples, influence.scales, folded)).global_vector
    w, c = influence.samples, influence.scales
    expected = g + sum(wi * si * d.astype(np.float64) for wi, si, d in zip(w, c, deltas, strict=True)) / w.sum()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_fedavg_rebuilds_instead_of_cancelling_a_huge_tentative_fold():
    g = np.zeros(1000, np.float32)
    honest = np.full(1000, 1e-3, np.float32)
    huge = np.full(1000, 1e4, np.float32)
    fedavg = build_strategy({"name": "fedavg"})
    fedavg.begin(g, ())
    for d in (honest, huge):  # a bad tentative bound let the huge one in
        scan(d, fedavg.fold_plan(Tentative(max_norm=math.inf, samples=1.0)))
    cs = contributions([honest, huge], folded=[1.0, 1.0], scales=[1.0, float(np.linalg.norm(honest) / 1e4 / 31.6)])
    out = fedavg.aggregate(g, cs).global_vector
    expected = (honest + cs[1].scale * huge) / 2
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_uniform_weighting_ignores_sample_counts():
    rng = np.random.default_rng(1)
    deltas = [rng.standard_normal(50).astype(np.float32) for _ in range(3)]
    fedavg = build_strategy({"name": "fedavg", "weighting": "uniform"})
    fedavg.begin(np.zeros(50, np.float32), ())
    out = fedavg.aggregate(np.zeros(50, np.float32), contributions(deltas, samples=[1, 50, 900])).global_vector
    np.testing.assert_allclose(out, np.mean(deltas, axis=0), rtol=1e-5, atol=1e-6)


def test_median_and_trimmed_mean_by_hand():
    deltas = [np.array([1, 10, -3], np.float32), np.array([2, 20, -2], np.float32), np.array([100, -50, 0], np.float32)]
    g = np.zeros(3, np.float32)
    median = build_strategy({"name": "median"}).aggregate(g, contributions(deltas)).global_vector
    np.testing.assert_array_equal(median, [2, 10, -2])
    five = deltas + [np.array([3, 30, -1], np.float32), np.array([-100, 1000, 9], np.float32)]
    trimmed = build_strategy({"name": "trimmed-mean", "beta": 0.2}).aggregate(g, contributions(five)).global_vector
    np.testing.assert_allclose(trimmed, [2, 20, -1])  # drops min and max of each column, averages 3
    assert trim_count(5, 0.2) == 1 and trim_count(3, 0.49) == 1 and trim_count(2, 0.4) == 0


def test_robust_strategies_apply_the_clip_scale_first():
    deltas = [np.array([2.0, 0.0], np.float32)] * 3
    out = build_strategy({"name": "median"}).aggregate(np.zeros(2, np.float32), contributions(deltas, scales=[0.5] * 3))
    np.testing.assert_allclose(out.global_vector, [1.0, 0.0])


def test_krum_scores_by_hand_and_multi_krum_drops_the_outlier():
    points = np.array([[0.0], [1.0], [2.0], [10.0]])
    d2 = squared_distances(points @ points.T)
    np.testing.assert_allclose(d2[0], [0, 1, 4, 100])
    # n=4, f=0: each score sums the n-f-2 = 2 nearest others' squared distances
    np.testing.assert_allclose(krum_scores(d2, 0), [1 + 4, 1 + 1, 1 + 4, 64 + 81])
    deltas = [np.array([x, 0], np.float32) for x in (0.0, 1.0, 2.0, 1.5, 50.0)]
    result = build_strategy({"name": "krum", "f": 1}).aggregate(np.zeros(2, np.float32), contributions(deltas))
    assert result.detail == {"selected": ["a0", "a1", "a2", "a3"], "f_used": 1}
    np.testing.assert_allclose(result.global_vector, [1.125, 0])


def test_krum_lowers_f_when_too_few_updates_for_its_guarantee():
    deltas = [np.array([x], np.float32) for x in (0.0, 1.0, 2.0)]
    result = build_strategy({"name": "krum", "f": 2}).aggregate(np.zeros(1, np.float32), contributions(deltas))
    assert result.detail["f_used"] == 0


def test_column_blocks_cover_every_value_once_for_many_agents():
    rng = np.random.default_rng(3)
    deltas = [rng.standard_normal(300_001).astype(np.float32) for _ in range(40)]
    out = build_strategy({"name": "median"}).aggregate(np.zeros(300_001, np.float32), contributions(deltas))
    np.testing.assert_allclose(out.global_vector, np.median(np.stack(deltas), axis=0), rtol=1e-6)


@pytest.mark.parametrize(
    "table, message",
    [
        ({"name": "fedmagic"}, "strategy.name 'fedmagic' is unknown; choose one of auto, centered-clip, demlearn"),
        ({"name": "fedavg", "weighting": "loud"}, "strategy.weighting"),
        ({"name": "trimmed-mean", "beta": 0.5}, r"strategy.beta must be in \[0, 0.5\)"),
        ({"name": "krum", "f": -1}, "strategy.f must be >= 0"),
        ({"name": "median", "beta": 0.1}, "strategy.beta is not a known key"),
        ({"name": "krum", "f": "two"}, "strategy.f has the wrong type"),
        ({"name": "fedswap", "h1": 0}, "strategy.h1 must be >= 1"),
        ({"name": "simfedswap", "pairing": "best"}, "strategy.pairing 'best' must be one of random, gs, mss"),
        (
            {"name": "simfedswap", "similarity": "cosine"},
            "strategy.similarity 'cosine' must be one of osad, cca, hsic, cka, rbf-cka, dcka",
        ),
        ({"name": "fedswap", "sp": 1.5}, r"strategy.sp must be in \[0, 1\]"),
        ({"name": "fedswap", "h3": 2}, "strategy.h3 is not a known key; known keys: h1, h2, sp"),
    ],
)
def test_bad_strategy_options_name_the_key(table, message):
    with pytest.raises(ValueError, match=message):
        build_strategy(table)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"clip": "sometimes"}, "bounds.clip must be one of adaptive, fixed, off"),
        ({"clip": "fixed"}, "bounds.clip_norm must be > 0"),
        ({"clip_multiple": 0.5}, "bounds.clip_multiple must be >= 1"),
        ({"sample_multiple": 0.5}, "bounds.sample_multiple must be 0"),
        ({"max_samples": -1}, "bounds.max_samples must be >= 0"),
    ],
)
def test_bad_bounds_name_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        InfluencePolicy(**values)


def test_bounds_cap_claims_and_clip_to_a_multiple_of_the_lower_median():
    norms, claims = np.array([1.0, 2.0, 3.0, 3.0, 400.0]), np.array([10, 20, 30, 30, 1e15])
    influence = bound_influence(InfluencePolicy(), norms, claims)
    assert influence.clip_bound == 2 * 3.0  # lower median of five: the 3rd smallest
    np.testing.assert_allclose(influence.scales, [1, 1, 1, 1, 6 / 400])
    assert influence.sample_cap == 2 * 30
    np.testing.assert_allclose(influence.samples, [10, 20, 30, 30, 60])
    off = bound_influence(InfluencePolicy(clip="off", sample_multiple=0), np.array([1.0, 1e9]), np.array([1, 1e15]))
    assert math.isinf(off.clip_bound) and list(off.scales) == [1, 1] and off.samples[1] == 1e15


def test_in_a_round_of_two_the_larger_update_is_bounded_by_the_smaller():
    """The plain median of two values is their mean: a large one would lift its own bound."""
    influence = bound_influence(InfluencePolicy(), np.array([1.948, 20 * 1.948]), np.array([100, 2**53]))
    assert influence.clip_bound == pytest.approx(2 * 1.948) and influence.sample_cap == 100
    np.testing.assert_allclose(influence.scales, [1, 0.1])
    np.testing.assert_allclose(influence.samples, [100, 100])


@pytest.mark.parametrize("claims", [2, 3, 4, 5, 6, 10])
def test_among_few_participants_no_claim_buys_more_than_a_third_of_the_weight(claims):
    """With the default multiple of 2, one inflated claim among three held half the weight."""
    samples = np.array([100.0] * (claims - 1) + [1e15])
    capped = bound_influence(InfluencePolicy(), np.ones(claims), samples).samples
    share = capped[-1] / capped.sum()
    assert share <= (0.5 if claims == 2 else 1 / 3) + 1e-9
    assert capped[-1] == 100 * min(2.0, max(1.0, (claims - 1) / 2))  # from five claims on: the configured multiple


def test_centered_clip_by_hand_and_its_reference_moves_only_on_commit():
    strategy = build_strategy({"name": "centered-clip", "weighting": "uniform"})
    strategy.restore({"reference": np.array([1.0, 0.0], np.float32)})  # last round's change
    deltas = [np.array(x, np.float32) for x in ([1.0, 0.0], [1.2, 0.0], [-1.0, 0.0])]  # the last one flipped
    result = strategy.aggregate(np.zeros(2, np.float32), contributions(deltas))
    # distances to v: 0, 0.2, 2 -> tau = lower median = 0.2 -> the flipped one counts 0.1 of itself
    np.testing.assert_allclose(result.global_vector, [1.0, 0.0], atol=1e-6)
    assert result.detail["centered_clipped"] == ["a2"] and result.detail["tau"] == pytest.approx(0.2)
    np.testing.assert_array_equal(strategy.state()["reference"], [1.0, 0.0])  # not committed yet
    strategy.on_commit(result)
    np.testing.assert_allclose(strategy.state()["reference"], [1.0, 0.0], atol=1e-6)
    fresh = build_strategy({"name": "centered-clip"})
    first = fresh.aggregate(np.zeros(2, np.float32), contributions(deltas, samples=[1, 1, 1]))
    np.testing.assert_allclose(first.global_vector, [(1.0 + 1.0 - 1.0) / 3, 0.0], atol=1e-6)  # v = 0: tau = 1


def test_bucketed_centered_clip_clips_the_weighted_means_of_its_groups():
    """``bucket = 2``: the updates are averaged in seeded pairs (weighted by samples), and the pair means are
    what is clipped around the reference and averaged by their groups' weights."""
    from flcore.strategies.centered_clip import buckets

    rng = np.random.default_rng(3)
    deltas = [rng.normal(size=4).astype(np.float32) for _ in range(5)]
    deltas[4] = -10 * deltas[0]  # one far off
    samples = [10.0, 20.0, 30.0, 40.0, 50.0]
    strategy = build_strategy({"name": "centered-clip", "bucket": 2})
    result = strategy.aggregate(np.zeros(4, np.float32), contributions(deltas, samples=samples))
    groups = buckets([f"a{i}" for i in range(5)], 2)
    assert sorted(len(g) for g in groups) == [1, 2, 2] and sorted(i for g in groups for i in g) == list(range(5))
    assert groups == buckets([f"a{i}" for i in reversed(range(5))], 2)  # seeded by the names, not their order
    weights = np.array([sum(samples[i] for i in g) for g in groups])
    means = np.array([sum(samples[i] * deltas[i] for i in g) / w for g, w in zip(groups, weights, strict=True)])
    distances = np.linalg.norm(means, axis=1)  # the reference is zero in the first round
    tau = np.sort(distances)[(len(distances) - 1) // 2]  # lower median
    clip = np.minimum(1.0, tau / distances)
    expected = (weights * clip) @ means / weights.sum()
    np.testing.assert_allclose(result.global_vector, expected, rtol=1e-5, atol=1e-6)
    group_of_far = next(g for g in groups if 4 in g)
    assert set(result.detail["centered_clipped"]) >= {f"a{i}" for i in group_of_far}
    with pytest.raises(ValueError, match="strategy.bucket"):
        build_strategy({"name": "centered-clip", "bucket": 0})


def test_centered_clip_never_extrapolates_running_statistics():
    """Last round's drop of a running variance, re-applied as a reference, would make it negative."""
    spec = (TensorSpec("conv.weight", "float32", (2,)), TensorSpec("bn.running_var", "float32", (1,)))
    strategy = build_strategy({"name": "centered-clip", "weighting": "uniform"})
    strategy.begin(np.array([0.0, 0.0, 1.0], np.float32), spec)
    deltas = [np.array(x, np.float32) for x in ([1.0, 0.0, -0.9], [1.1, 0.0, -0.9], [-1.0, 0.0, -0.9])]
    strategy.on_commit(strategy.aggregate(np.array([0.0, 0.0, 1.0], np.float32), contributions(deltas)))
    reference = strategy.state()["reference"]
    assert reference[0] > 0 and reference[2] == 0  # momentum on weights only
    strategy.begin(np.array([0.0, 0.0, 0.1], np.float32), spec)
    flipped = [np.array(x, np.float32) for x in ([1.0, 0.0, -0.05], [1.1, 0.0, -0.05], [-1.0, 0.0, -0.05])]
    out = strategy.aggregate(np.array([0.0, 0.0, 0.1], np.float32), contributions(flipped)).global_vector
    assert 0 <= out[2] <= 0.1


def test_fedadam_and_fedyogi_take_the_hand_computed_step_and_keep_state_only_on_commit():
    deltas = [np.array([1.0, -1.0], np.float32), np.array([3.0, -1.0], np.float32)]  # mean change (2, -1)
    g = np.zeros(2, np.float32)
    adam = build_strategy({"name": "fedadam", "weighting": "uniform", "server_lr": 0.1, "tau": 1e-3})
    adam.begin(g, (TensorSpec("w", "float32", (2,)),))
    first = adam.aggregate(g, contributions(deltas))
    # m = 0.1 * (2, -1); v = 0.01 * (4, 1); step = 0.1 * m / (sqrt(v) + 1e-3)
    np.testing.assert_allclose(first.global_vector, [0.1 * 0.2 / (0.2 + 1e-3), 0.1 * -0.1 / (0.1 + 1e-3)], rtol=1e-5)
    assert adam.state()["m"].tolist() == [0.0, 0.0]  # not committed yet
    adam.on_commit(first)
    np.testing.assert_allclose(adam.state()["m"], [0.2, -0.1], rtol=1e-6)
    yogi = build_strategy({"name": "fedyogi", "weighting": "uniform", "server_lr": 0.1})
    yogi.begin(g, (TensorSpec("w", "float32", (2,)),))
    yogi.on_commit(yogi.aggregate(g, contributions(deltas)))
    np.testing.assert_allclose(yogi.state()["v"], [0.01 * 4, 0.01 * 1], rtol=1e-5)  # v = 0 - 0.01*d²*sign(-d²)


def test_fedavgm_accumulates_velocity_and_leaves_running_statistics_to_plain_averaging():
    spec = (TensorSpec("w", "float32", (1,)), TensorSpec("bn.running_var", "float32", (1,)))
    g = np.array([0.0, 1.0], np.float32)
    momentum = build_strategy({"name": "fedavgm", "weighting": "uniform", "momentum": 0.5, "server_lr": 1.0})
    for expected in ([1.0, 0.5], [1.5, 0.5]):  # velocity 1, then 0.5 * 1 + 1; the variance moves by -0.5 each time
        momentum.begin(g, spec)
        result = momentum.aggregate(g, contributions([np.array([1.0, -0.5], np.float32)]))
        momentum.on_commit(result)
        np.testing.assert_allclose(result.global_vector - g, [expected[0], -0.5])
    with pytest.raises(ValueError, match=r"strategy.momentum must be in \[0, 1\)"):
        build_strategy({"name": "fedavgm", "momentum": 1.0})


def test_threshold_closes_a_round_once_k_updates_are_in_and_is_validated():
    from flcore.rounds import RoundRules, RoundState, UpdateRecord, decide

    state = RoundState(round=1, attempt=1, selected=["a", "b", "c"], deadline=100.0, started_at=0.0)
    state.updates.append(UpdateRecord(agent="a", samples=1, loss=0.1, norm=1.0, wire_bytes=1))
    rules = RoundRules(min_agents=3, quorum=3)
    assert decide(state, rules, now=1.0) == "wait" and decide(state, rules, now=1.0, threshold=2) == "wait"
    state.updates.append(UpdateRecord(agent="b", samples=1, loss=0.1, norm=1.0, wire_bytes=1))
    assert decide(state, rules, now=1.0, threshold=2) == "close"
    assert build_strategy({"name": "krum", "threshold": 2}).threshold == 2
    with pytest.raises(ValueError, match="strategy.threshold must be a whole number >= 0"):
        build_strategy({"name": "fedavg", "threshold": 1.5})
