"""Differential privacy with weights and with robust strategies: DP-FedAvg's capped weights over a fixed
denominator against a numpy reference, every private strategy's sensitivity bound against what one agent
can actually move, the noise the engine adds, the refusals, and ``skyfed sim`` end to end."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_server.config import ConfigError, load_server_config
from broker_server.privacy.noise import NORM_SLACK, AddNoise
from broker_server.privacy.policy import PrivacyPolicy
from broker_server.rounds.engine import RoundEngine
from broker_server.rounds.pipeline import RoundContext
from flcore.bounds import InfluencePolicy, bound_influence
from flcore.dp_sensitivity import multi_krum_sensitivity, trimmed_mean_sensitivity
from flcore.rounds import RoundState
from flcore.strategies import build_strategy
from flcore.strategies.base import Contribution
from models.weights import TensorSpec
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import ServerHarness, override_toml
from tests.fixtures import dp_completed
from tests.liveharness import metrics_rows, skyfed

Z, S, CAP = 1.5, 0.5, 100.0
AGENTS = ["agent-01", "agent-02", "agent-03"]


def test_weighted_dp_fedavg_is_the_capped_weighted_sum_over_the_number_of_updates_plus_noise_of_z_s_over_n():
    rng = np.random.default_rng(7)
    size = 200_000
    deltas = [rng.standard_normal(size).astype(np.float32) * scale for scale in (1e-3, 5e-3, 1e-2, 2e-4)]
    norms = np.array([float(np.linalg.norm(d)) for d in deltas])  # 0.45, 2.2, 4.5, 0.09: three under S = 0.5
    claims = np.array([10, 250, 10**9, 50])  # one agent claims a billion samples
    privacy = PrivacyPolicy(clip=S, noise_multiplier=Z, weight_cap=CAP)
    influence = bound_influence(privacy.bounds(InfluencePolicy()), norms, claims)
    assert np.array_equal(influence.samples, claims)  # no cap relative to the others' claims: it would couple them
    contributions = [
        Contribution(f"a{i}", d, float(c), float(scale), float(norm))
        for i, (d, c, scale, norm) in enumerate(zip(deltas, influence.samples, influence.scales, norms, strict=True))
    ]
    strategy = build_strategy({"name": "fedavg", "weighting": "samples"})
    privacy.configure(strategy)
    spec = (TensorSpec("w", "float32", (size,)),)
    start = rng.standard_normal(size).astype(np.float32)
    strategy.begin(start, spec)
    averaged = strategy.average(start, contributions)

    weights = np.minimum(claims / CAP, 1.0)  # 0.1, 1, 1, 0.5
    clipped = [d * min(1.0, S / n) for d, n in zip(deltas, norms, strict=True)]
    reference = start + sum(w * c for w, c in zip(weights, clipped, strict=True)) / 4  # 4 updates, not Σw = 2.6
    np.testing.assert_allclose(averaged.global_vector, reference, rtol=1e-5, atol=1e-7)

    state = RoundState(round=1, attempt=1, selected=[c.agent for c in contributions], deadline=0.0, started_at=0.0)
    ctx = RoundContext(state, {"w": start}, start, spec, lambda agent: deltas[0])
    ctx.contributions, ctx.influence, ctx.result = contributions, influence, averaged
    AddNoise(privacy, strategy.dp_sensitivity).run(ctx)
    assert ctx.noise_std == pytest.approx(Z * S * (1 + NORM_SLACK) / 4)  # std z·S on the sum, divided by 4
    noise = ctx.result.global_vector - reference
    assert np.std(noise) == pytest.approx(ctx.noise_std, rel=0.01)
    assert abs(float(np.mean(noise))) < 5 * ctx.noise_std / math.sqrt(size)


def _private(name: str, beta: float):  # noqa: ANN202
    """The strategy ``name`` as the engine sets it up under privacy (weighted FedAvg with the cap)."""
    options = {"fedavg": {"weighting": "samples"}, "trimmed-mean": {"beta": beta}, "krum": {"f": 1}}.get(name, {})
    strategy = build_strategy({"name": name, **options})
    PrivacyPolicy(clip=S, noise_multiplier=1.0, weight_cap=CAP if name == "fedavg" else 0.0).configure(strategy)
    return strategy


def _aggregate(name: str, updates: np.ndarray, claims: np.ndarray, beta: float) -> np.ndarray:
    strategy = _private(name, beta)
    zero = np.zeros(updates.shape[1], np.float32)
    strategy.begin(zero, (TensorSpec("w", "float32", (updates.shape[1],)),))
    contributions = [
        Contribution(f"a{i}", u, float(c), 1.0, float(np.linalg.norm(u)))
        for i, (u, c) in enumerate(zip(updates, claims, strict=True))
    ]
    return strategy.average(zero, contributions).global_vector


def _clipped(rows: list[list[float]]) -> np.ndarray:
    updates = np.array(rows, np.float32)
    norms = np.linalg.norm(updates, axis=1, keepdims=True)
    return (updates * np.minimum(1.0, S / np.maximum(norms, 1e-30))).astype(np.float32)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(["fedavg", "trimmed-mean", "median", "krum"]),
    n=st.integers(2, 9),
    dims=st.integers(1, 4),
    beta=st.sampled_from([0.1, 0.2, 0.34, 0.49]),
    data=st.data(),
)
def test_no_agent_moves_a_private_aggregate_further_than_the_sensitivity_its_noise_is_calibrated_to(
    name, n, dims, beta, data
):
    """Zeroing any one agent's clipped update (and, for weighted FedAvg, whatever its claimed weight) moves
    the aggregate by at most the strategy's ``dp_sensitivity``: the proofs of ``flcore.dp_sensitivity``
    checked on updates hypothesis picks (extreme values, ties, exact zeros)."""
    value = st.sampled_from([0.0, S, -S, S / 2]) | st.floats(-S, S, width=32)
    rows = data.draw(st.lists(st.lists(value, min_size=dims, max_size=dims), min_size=n, max_size=n))
    claims = np.array(data.draw(st.lists(st.sampled_from([1, 50, 100, 10**9]), min_size=n, max_size=n)))
    updates = _clipped(rows)
    bound = _private(name, beta).dp_sensitivity(n, S)
    assert bound == pytest.approx(_bound(name, n, beta))
    base = _aggregate(name, updates, claims, beta)
    for k in range(n):
        neighbour = updates.copy()
        neighbour[k] = 0
        moved = float(np.linalg.norm(_aggregate(name, neighbour, claims, beta) - base))
        assert moved <= bound * (1 + 1e-4) + 1e-6, (name, k, moved, bound)


def _bound(name: str, n: int, beta: float) -> float:
    """The bounds of ``flcore.dp_sensitivity``, written out by hand."""
    if name == "fedavg":
        return S / n
    if name == "krum":  # f = 1: keep K = n - f_used, f_used = min(1, (n - 3) // 2)
        keep = n - min(1, max((n - 3) // 2, 0))
        return S * min(2 * (n - keep) + 1, 2 * keep) / keep
    trimmed = (n - 1) // 2 if name == "median" else min(int(beta * n), (n - 1) // 2)
    return S / (n - 2 * trimmed)


@pytest.mark.parametrize(
    ("name", "rows", "zeroed"),
    [
        ("median", [[0.0], [S], [S]], 1),  # median S, then 0
        ("trimmed-mean", [[0.0, 0.0], [S, 0.0], [S, 0.0], [S, 0.0], [0.0, -S]], 2),  # k = 1: 2S/3, then S/3
        ("fedavg", [[S, 0.0], [0.0, S], [0.0, S]], 0),
    ],
)
def test_the_sensitivity_bounds_are_reached_so_the_noise_is_no_larger_than_needed(name, rows, zeroed):
    updates = _clipped(rows)
    claims = np.full(len(rows), CAP)
    neighbour = updates.copy()
    neighbour[zeroed] = 0
    moved = float(np.linalg.norm(_aggregate(name, neighbour, claims, 0.2) - _aggregate(name, updates, claims, 0.2)))
    assert moved == pytest.approx(_private(name, 0.2).dp_sensitivity(len(rows), S), rel=1e-6)


def test_without_the_cap_one_agents_claim_moves_sample_weighted_fedavg_by_nearly_s_which_is_why_it_is_refused():
    updates = _clipped([[S, 0.0], [0.0, S], [0.0, -S], [-S, 0.0]])
    claims = np.array([10**9, 10, 10, 10])
    strategy = build_strategy({"name": "fedavg", "weighting": "samples"})  # no weight_cap: nₖ / Σ nⱼ
    zero = np.zeros(2, np.float32)
    strategy.begin(zero, (TensorSpec("w", "float32", (2,)),))
    base = strategy.average(zero, [Contribution(f"a{i}", u, float(c), 1.0, S) for i, (u, c) in
                                   enumerate(zip(updates, claims, strict=True))]).global_vector  # fmt: skip
    assert np.linalg.norm(base) > 0.99 * S > S / 4  # 4·(the private bound S/4): far past it


def _engine(tmp_path, strategy: dict, privacy: dict) -> RoundEngine:  # noqa: ANN001
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=10, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3}, strategy=strategy, privacy=privacy)
    return RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600),
                       evaluator=lambda arrays: {"accuracy": 0.5})  # fmt: skip


def test_the_engine_averages_capped_object_weights_over_the_count_and_publishes_no_weight(tmp_path):
    """SmartFed's object weighting under DP: the update's weight (objects for detectors, carried as
    ``UpdateMeta.weight``) is capped at ŵ, the sum divided by 3, and the metrics show neither weights nor caps."""
    z = 1e-4  # noise far below the clean average's values: a wrong weight or denominator shows in the residual
    engine = _engine(tmp_path, {"name": "fedavg", "weighting": "samples"},
                     {"clip": S, "noise_multiplier": z, "weight_cap": CAP})  # fmt: skip
    before = engine.global_vector.copy()
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    objects = [30, 100, 10**6]
    for i, (agent, weight) in enumerate(zip(AGENTS, objects, strict=True)):
        engine.accept(dp_completed(engine, agent, seed=i, samples=weight), now=1.0)
    deltas = [engine.state.store.updates.delta(1, agent) for agent in AGENTS]
    clipped = [d * min(1.0, S / float(np.linalg.norm(d))) for d in deltas]
    clean = sum(min(w / CAP, 1.0) * d for w, d in zip(objects, clipped, strict=True))
    metrics = engine.close(now=1.0, model_wire_bytes=0)
    assert metrics.outcome == "committed" and set(metrics.aggregation) == {"clip_bound", "noise_std"}
    assert metrics.aggregation["noise_std"] == pytest.approx(z * S * (1 + NORM_SLACK) / 3)
    noise = engine.global_vector - before - clean / 3
    assert np.std(noise) == pytest.approx(metrics.aggregation["noise_std"], rel=0.05)


@pytest.mark.parametrize(
    ("strategy", "sensitivity"),
    [
        ({"name": "trimmed-mean", "beta": 0.34}, trimmed_mean_sensitivity(3, 1, 1.0)),  # k = 1 of 3: the median
        ({"name": "median"}, trimmed_mean_sensitivity(3, 1, 1.0)),
        ({"name": "krum", "f": 1}, multi_krum_sensitivity(3, 3, 1.0)),  # 3 < 2f + 3: f falls to 0, the mean
    ],
)
def test_robust_strategies_under_privacy_get_noise_of_their_own_sensitivity_and_publish_no_selection(
    tmp_path, strategy, sensitivity
):
    engine = _engine(tmp_path, strategy, {"clip": S, "noise_multiplier": Z})
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(AGENTS):
        engine.accept(dp_completed(engine, agent, seed=i), now=1.0)
    metrics = engine.close(now=1.0, model_wire_bytes=0)
    assert metrics.outcome == "committed" and set(metrics.aggregation) == {"clip_bound", "noise_std"}
    assert metrics.aggregation["noise_std"] == pytest.approx(Z * S * (1 + NORM_SLACK) * sensitivity)


@pytest.mark.parametrize(
    ("privacy", "weighting"),
    [
        ({"clip": S, "noise_multiplier": Z}, "uniform"),
        ({"clip": S, "noise_multiplier": Z, "weight_cap": CAP}, "samples"),
    ],
)
def test_under_privacy_no_strategy_name_runs_fedavg_and_says_so(tmp_path, caplog, privacy, weighting):
    with caplog.at_level(logging.INFO, logger="skyfed.server"):
        engine = _engine(tmp_path, {}, privacy)
    assert engine.strategy.name == "fedavg" and engine.strategy.options.weighting == weighting
    assert engine.strategy.weight_cap == privacy.get("weight_cap", 0.0)
    assert f"aggregation default under privacy: fedavg weighting={weighting}" in caplog.text
    assert "aggregation default: auto" not in caplog.text


@pytest.mark.parametrize(
    ("strategy", "privacy", "message"),
    [
        ({"name": "fedavg", "weighting": "samples"}, {}, 'weighting = "samples" needs privacy.weight_cap: .*median'),
        ({"name": "fedadam"}, {}, "needs privacy.weight_cap"),  # FedAvg's default weighting is samples
        ({"name": "fedavg", "weighting": "uniform"}, {"weight_cap": CAP}, "privacy.weight_cap caps sample weights"),
        ({"name": "trimmed-mean"}, {"weight_cap": CAP}, "strategy trimmed-mean is unweighted: remove privacy.weight"),
        ({"name": "krum", "f": 1}, {"weight_cap": CAP}, "strategy krum is unweighted"),
        ({"name": "centered-clip"}, {}, "'centered-clip': .*Use fedavg, .* weighting = .uniform. .* or .*trimmed-mean"),
        ({"name": "auto"}, {}, "'auto': .*remove strategy.name and auto's f and agreement: under privacy the default"),
    ],
)
def test_a_server_toml_that_would_not_be_private_is_refused_naming_the_key_or_what_works(
    tmp_path, strategy, privacy, message
):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=2, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, strategy=strategy, privacy={"clip": S, "noise_multiplier": Z, **privacy})
    with pytest.raises(ConfigError, match=message):
        load_server_config(layout.server_config)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"weight_cap": 100.0}, "privacy.clip must be > 0 to turn differential privacy on .*weight_cap"),
        ({"clip": S, "noise_multiplier": Z, "weight_cap": -1.0}, "privacy.weight_cap must be a number >= 0"),
    ],
)
def test_a_weight_cap_without_privacy_or_below_zero_is_refused(values, message):
    with pytest.raises(ValueError, match=message):
        PrivacyPolicy(**values)


def test_skyfed_sim_runs_object_or_sample_weighted_fedavg_under_dp_with_a_weight_cap(tmp_path):
    # the noise is drawn fresh (broker_server.privacy.gaussian) and can trip the collapse rollback (once in CI, in
    # none of 26 runs by hand): off, so that every round commits
    base = ["sim", "--in-process", "--agents", "4", "--rounds", "2", "--strategy", "fedavg", "--dp-clip", "0.5",
            "--dp-noise", "1.0", "--strategy-option", "weighting=samples",
            "--bounds-option", "collapse_ratio=0"]  # fmt: skip
    refused = skyfed(*base, "--out", str(tmp_path / "refused"), timeout=120)
    assert refused.returncode != 0 and "needs privacy.weight_cap" in refused.stderr, refused.stderr
    out = tmp_path / "run"
    result = skyfed(*base, "--dp-weight-cap", "300", "--out", str(out), timeout=180)
    assert result.returncode == 0, result.stderr
    rows = metrics_rows(out)
    assert [r["round"] for r in rows] == [1, 2] and all(r["outcome"] == "committed" for r in rows)
    for row in rows:
        assert set(row["aggregation"]) == {"clip_bound", "noise_std"}
        assert row["aggregation"]["noise_std"] == pytest.approx(1.0 * 0.5 * (1 + NORM_SLACK) / 4, rel=1e-5)
    assert rows[-1]["privacy"]["max_rounds_per_agent"] == 2 and "final accuracy" in result.stdout


def test_the_aggregator_daemon_runs_capped_weights_under_dp_over_the_broker_and_publishes_no_weight(tmp_path, broker):
    """The daemon path: two agents' sealed updates over mosquitto, one claiming a million samples. The
    published model is the capped weighted sum over 2 (plus noise far below it), and the metrics on the
    broker carry only the clip bound and the noise."""
    z = 1e-4
    with ServerHarness(tmp_path, broker, agents=2, strategy={"name": "fedavg", "weighting": "samples"},
                       privacy={"clip": S, "noise_multiplier": z, "weight_cap": CAP}) as h:  # fmt: skip
        h.announce_agents()
        deltas, claims = [h.random_delta(seed) for seed in (1, 2)], [40, 10**6]
        for agent, delta, samples in zip(sorted(h.agents), deltas, claims, strict=True):
            h.send(agent, delta, samples=samples)
        metrics = h.wait_metrics()
        model = h.final_model()
    assert metrics.outcome == "committed" and set(metrics.aggregation) == {"clip_bound", "noise_std"}
    assert metrics.aggregation["noise_std"] == pytest.approx(z * S * (1 + NORM_SLACK) / 2)
    norms = [math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in d.values())) for d in deltas]
    scales = [min(1.0, S / norm) for norm in norms]
    weights = [min(c / CAP, 1.0) for c in claims]  # 0.4 and 1 (sample weighting would give 0.99996 to the second)
    for key in deltas[0]:
        expected = h.initial[key] + sum(w * s * d[key] for w, s, d in zip(weights, scales, deltas, strict=True)) / 2
        np.testing.assert_allclose(model[key], expected, atol=10 * metrics.aggregation["noise_std"] + 1e-6)
