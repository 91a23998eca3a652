"""Central DP beyond a fixed clip and plain FedAvg: adaptive clipping (Andrew et al. 2021) and the
server optimizers stepping on the noisy average."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.privacy_accountant import NeighboringRelation

from broker_server.config import load_server_config
from broker_server.privacy.adaptive_clip import AdaptClip, next_clip, noisy_unclipped_fraction
from broker_server.privacy.noise import NORM_SLACK
from broker_server.privacy.policy import PrivacyPolicy
from broker_server.rounds.engine import RoundEngine
from broker_server.rounds.pipeline import RoundContext
from flcore.bounds import Influence
from flcore.rounds import RoundState
from flcore.strategies.base import Contribution
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml
from tests.fixtures import dp_completed

AGENTS = ["agent-01", "agent-02", "agent-03"]


def _engine(tmp_path, strategy: dict, privacy: dict) -> RoundEngine:  # noqa: ANN001
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=10, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3},
                  strategy={"weighting": "uniform", **strategy}, privacy=privacy)  # fmt: skip
    return RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600),
                       evaluator=lambda arrays: {"accuracy": 0.5})  # fmt: skip


def _round(engine: RoundEngine, seed: int = 0):  # noqa: ANN202
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(AGENTS):
        engine.accept(dp_completed(engine, agent, seed=seed * 10 + i), now=1.0)
    return engine.close(now=1.0, model_wire_bytes=0)


@pytest.mark.parametrize(("z", "sigma_b"), [(1.0, 0.6), (1.0, 5.0), (3.0, 50.0)])
def test_the_update_noise_and_the_count_noise_together_cost_exactly_one_gaussian_of_multiplier_z(z, sigma_b):
    """Andrew et al.'s Theorem 1, checked with the accountant: the update's Gaussian (multiplier z_Δ) and the
    centred count's (sensitivity 1/2, noise σ_b: multiplier 2σ_b) compose to the Gaussian of multiplier z."""
    policy = PrivacyPolicy(clip=0.1, noise_multiplier=z, adaptive_clip=True, clip_count_stddev=sigma_b)
    z_update = policy.update_noise_multiplier(100)
    assert z_update > z

    def epsilon(*multipliers: float) -> float:
        accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)
        for m in multipliers:
            accountant.compose(dp_accounting.GaussianDpEvent(m), 10)
        return accountant.get_epsilon(1e-5)

    assert epsilon(z_update, 2 * sigma_b) == pytest.approx(epsilon(z), rel=1e-6)
    automatic = PrivacyPolicy(clip=0.1, noise_multiplier=z, adaptive_clip=True)
    assert automatic.count_stddev(1000) == 50 and automatic.count_stddev(3) == z  # m/20, floored at z
    assert automatic.update_noise_multiplier(3) == pytest.approx(z / math.sqrt(0.75))


def test_the_clip_settles_near_the_target_quantile_of_the_norms():
    rng = np.random.default_rng(0)
    clip = 10.0  # far above every norm
    for _ in range(300):
        norms = rng.lognormal(mean=0.0, sigma=0.5, size=200)  # median 1
        clip = next_clip(clip, noisy_unclipped_fraction(norms, clip, 200 / 20, rng), 0.5, 0.2)
    assert 0.8 < clip < 1.25
    assert next_clip(1.0, 0.9, 0.5, 0.2) < 1.0 < next_clip(1.0, 0.1, 0.5, 0.2)  # shrinks when most fit
    huge_noise = [noisy_unclipped_fraction(np.ones(3), 2.0, 1e6, rng) for _ in range(100)]  # σ_b ≫ n
    assert min(huge_noise) == 0.0 and max(huge_noise) == 1.0  # clamped: S moves by e^(±0.1) at most


def test_the_clip_stays_within_its_range_whatever_the_updates_say():
    """A round of only zero updates (every one fits) would shrink S by e^(-0.1); clip_range = 1.05 stops it."""
    policy = PrivacyPolicy(clip=1.0, noise_multiplier=1.0, adaptive_clip=True, clip_range=1.05)
    state = RoundState(round=1, attempt=1, selected=["a"], deadline=0.0, started_at=0.0)
    ctx = RoundContext(state, {}, np.zeros(4, np.float32), (), lambda a: np.zeros(4, np.float32))
    ctx.contributions = [Contribution(f"a{i}", np.zeros(4, np.float32), 1.0, 1.0, 0.0) for i in range(100)]
    ctx.influence = Influence(1.0, math.inf, np.ones(100), np.ones(100))
    AdaptClip(policy).run(ctx)
    assert ctx.next_clip == pytest.approx(1 / 1.05)


def test_the_engine_adapts_the_clip_round_by_round_publishes_it_and_a_restart_keeps_it(tmp_path):
    # σ_b = 0.11 keeps the count's noise far below the 1.5 that separates "all 3 fit" from "half fit"
    privacy = {"clip": 50.0, "noise_multiplier": 0.2, "adaptive_clip": True, "clip_count_stddev": 0.11}
    engine = _engine(tmp_path, {"name": "fedavg"}, privacy)
    first, second = _round(engine, 0), _round(engine, 1)
    assert first.aggregation["clip_bound"] == 50.0 and first.aggregation["unclipped_fraction"] > 0.5
    assert second.aggregation["clip_bound"] == pytest.approx(first.aggregation["next_clip"], rel=1e-5)
    assert second.aggregation["next_clip"] < second.aggregation["clip_bound"] < 50.0  # every update fits: shrink
    expected_std = (
        PrivacyPolicy(**privacy).update_noise_multiplier(3) * second.aggregation["clip_bound"] * (1 + NORM_SLACK) / 3
    )
    assert second.aggregation["noise_std"] == pytest.approx(expected_std, rel=1e-5)
    assert second.privacy["clip"] == pytest.approx(second.aggregation["next_clip"], rel=1e-5)
    assert set(second.aggregation) == {"clip_bound", "noise_std", "unclipped_fraction", "next_clip"}
    resumed = RoundEngine(engine.config, replay=ReplayGuard(3600))
    assert resumed.ledger.clip == engine.ledger.clip != 50.0


def test_a_server_optimizer_steps_on_the_noisy_average_not_the_clean_one(tmp_path):
    """FedAvgM with η = 1: after round 1 its velocity is the model's change, and that change is the
    clipped average plus the noise (the noise entered before the optimizer, so its state is public)."""
    engine = _engine(tmp_path, {"name": "fedavgm", "server_lr": 1.0, "momentum": 0.9},
                     {"clip": 100.0, "noise_multiplier": 1.0})  # fmt: skip
    before = engine.global_vector.copy()
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(AGENTS):
        engine.accept(dp_completed(engine, agent, seed=i), now=1.0)
    clean = np.mean([engine.state.store.updates.delta(1, agent) for agent in AGENTS], axis=0)  # all far under the clip
    metrics = engine.close(now=1.0, model_wire_bytes=0)
    velocity = engine.strategy.state_arrays["velocity"]
    np.testing.assert_allclose(velocity, engine.global_vector - before, rtol=1e-5, atol=1e-6)
    noise = velocity - clean
    assert np.std(noise) == pytest.approx(metrics.aggregation["noise_std"], rel=0.05)
    assert [s.name for s in engine.steps] == [
        "bound",
        "aggregate",
        "plan-starts",
        "check",
        "add-noise",
        "server-step",
        "evaluate",
        "export-onnx",
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"adaptive_clip": True}, "privacy.adaptive_clip needs privacy.clip > 0"),
        ({"clip": 0.1, "noise_multiplier": 1.0, "adaptive_clip": True, "target_quantile": 1.0}, "target_quantile"),
        ({"clip": 0.1, "noise_multiplier": 1.0, "adaptive_clip": True, "clip_learning_rate": 800.0},
         r"clip_learning_rate must be in \(0, 1\]"),
        ({"clip": 0.1, "noise_multiplier": 1.0, "adaptive_clip": True, "clip_range": 1.0}, "clip_range"),
        ({"clip": 0.1, "noise_multiplier": 2.0, "adaptive_clip": True, "clip_count_stddev": 1.0},
         "clip_count_stddev must be 0 .automatic. or above noise_multiplier / 2 = 1"),
    ],
)  # fmt: skip
def test_bad_adaptive_clip_settings_name_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        PrivacyPolicy(**values)
