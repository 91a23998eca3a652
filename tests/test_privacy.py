"""Central differential privacy: the accountant against the exact Gaussian mechanism, the noise step,
per-agent budgets across a restart, and the configurations that are refused."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from broker_server.config import load_server_config
from broker_server.privacy.accountant import PrivacyLedger, epsilon_of
from broker_server.privacy.noise import NORM_SLACK, AddNoise
from broker_server.privacy.policy import PrivacyPolicy
from broker_server.rounds.engine import RoundEngine
from broker_server.rounds.pipeline import RoundContext
from flcore.bounds import Influence, InfluencePolicy
from flcore.rounds import RoundState
from flcore.strategies.base import Contribution, RoundResult
from flcore.update import UpdateRejected
from models.weights import TensorSpec
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml
from tests.fixtures import dp_completed


def exact_epsilon(z: float, rounds: int, delta: float) -> float:
    """The optimal ε of ``rounds`` Gaussian mechanisms of noise multiplier z (Balle & Wang 2018, Thm 8:
    the composition is one Gaussian mechanism of multiplier z/√rounds)."""
    mu = math.sqrt(rounds) / z
    delta_of = lambda eps: norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)  # noqa: E731
    return brentq(lambda eps: delta_of(eps) - delta, 0.0, 500.0)


@pytest.mark.parametrize("z", [0.8, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("rounds", [1, 5, 20])
def test_the_accountant_never_reports_less_than_the_exact_epsilon_and_stays_close_to_it(z, rounds):
    reported = epsilon_of(((z, rounds),), 1e-5)
    exact = exact_epsilon(z, rounds, 1e-5)
    assert exact <= reported <= 1.15 * exact, (exact, reported)


def test_each_agent_pays_only_for_the_rounds_it_was_in_and_the_report_is_the_worst_agent():
    ledger = PrivacyLedger(PrivacyPolicy(clip=1.0, noise_multiplier=2.0, target_epsilon=3.5))
    ledger.after_round(["a", "b"], published=True)
    ledger.after_round(["a"], published=False)  # rolled back after the noise: charged all the same
    assert ledger.epsilon("a") == pytest.approx(epsilon_of(((2.0, 2),), 1e-5))
    assert ledger.epsilon("b") == pytest.approx(epsilon_of(((2.0, 1),), 1e-5))
    assert ledger.epsilon("b") < ledger.epsilon("a")
    assert ledger.epsilon("never-selected") == 0.0
    assert (
        ledger.summary()["epsilon"] == round(ledger.epsilon("a"), 4) and ledger.summary()["max_rounds_per_agent"] == 2
    )
    # 3 rounds at z = 2 cost 4.0 > 3.5: "a" (2 rounds) cannot afford a third, "b" can afford a second
    assert ledger.affordable(["a", "b", "c"]) == ["b", "c"]
    resumed = PrivacyLedger(ledger.policy, ledger.to_dict())
    assert resumed.epsilon("a") == ledger.epsilon("a")


def test_the_noise_step_adds_gaussian_noise_of_z_times_s_over_n_and_keeps_running_variances_valid():
    spec = (TensorSpec("w", "float32", (200_000,)), TensorSpec("bn.running_var", "float32", (1_000,)))
    mean = np.zeros(201_000, np.float32)
    mean[200_000:] = 0.01  # small variances: the noise would push many below zero
    state = RoundState(round=1, attempt=1, selected=["a"], deadline=0.0, started_at=0.0)
    ctx = RoundContext(state, {"w": np.zeros(200_000, np.float32)}, mean.copy(), spec, lambda a: mean)
    ctx.contributions = [Contribution(a, mean, 1.0, 1.0, 0.0) for a in ("a", "b", "c", "d")]
    ctx.result = RoundResult(mean.copy())
    ctx.influence = Influence(2.0, math.inf, np.ones(4), np.ones(4))  # the round's clip S = 2
    AddNoise(PrivacyPolicy(clip=2.0, noise_multiplier=1.5)).run(ctx)
    noise = ctx.result.global_vector[:200_000]
    assert ctx.noise_std == pytest.approx(1.5 * 2.0 * (1 + NORM_SLACK) / 4)  # S' covers float32 norms
    assert np.std(noise) == pytest.approx(0.75, rel=0.01) and abs(float(np.mean(noise))) < 0.01
    assert (ctx.result.global_vector[200_000:] >= 0).all() and (ctx.result.global_vector[200_000:] == 0).any()
    assert np.array_equal(ctx.candidate["w"], ctx.result.global_vector[:200_000])


@pytest.mark.parametrize(
    "strategy, bounds, message",
    [
        ({"name": "auto"}, InfluencePolicy(), "privacy cannot run strategy.name = 'auto': .*remove strategy.name"),
        ({"f": 3}, InfluencePolicy(), "privacy cannot run strategy.name = 'auto'"),  # auto's options: not defaulted
        ({"name": "centered-clip"}, InfluencePolicy(),
         "'centered-clip': .* Use fedavg, .* with weighting = .uniform.* or median"),
        ({"name": "fedswap", "weighting": "uniform", "aggregate": "krum"}, InfluencePolicy(),
         "strategy.aggregate = one of .*not 'krum'"),
        ({"name": "demlearn"}, InfluencePolicy(), "privacy cannot run strategy.name = 'demlearn'"),
        ({"name": "fedavg"}, InfluencePolicy(), 'strategy.weighting = "samples" needs privacy.weight_cap'),
        ({"name": "fedavg", "weighting": "uniform"}, InfluencePolicy(clip="off"), "bounds.clip must be left"),
        ({"name": "fedavg", "weighting": "uniform"}, InfluencePolicy(max_change_norm=5.0), "bounds.max_change_norm"),
        ({"name": "fedavg", "weighting": "uniform"}, InfluencePolicy(max_update_norm=5.0), "bounds.max_update_norm"),
    ],
)
def test_configurations_under_which_the_noise_would_not_protect_are_refused(strategy, bounds, message):
    with pytest.raises(ValueError, match=message):
        PrivacyPolicy(clip=1.0, noise_multiplier=1.0).check_compatible(strategy, bounds)
    PrivacyPolicy().check_compatible(strategy, bounds)  # privacy off: anything goes


def test_a_policy_with_clip_but_no_noise_is_refused():
    with pytest.raises(ValueError, match="privacy.noise_multiplier must be > 0"):
        PrivacyPolicy(clip=1.0)
    with pytest.raises(ValueError, match=r"privacy.delta must be in \(0, 1\)"):
        PrivacyPolicy(clip=1.0, noise_multiplier=1.0, delta=0.0)


def test_the_budget_stops_the_run_before_a_round_that_would_pass_it_and_a_restart_remembers(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=10, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3},
                  strategy={"name": "fedavg", "weighting": "uniform"},
                  privacy={"clip": 0.5, "noise_multiplier": 2.0, "target_epsilon": 3.5})  # fmt: skip
    config = load_server_config(layout.server_config)
    agents = ["agent-01", "agent-02", "agent-03"]
    engine = RoundEngine(config, replay=ReplayGuard(3600), evaluator=lambda arrays: {"accuracy": 0.5})
    before = engine.global_vector.copy()
    epsilons = []
    while engine.begin_round(agents, now=0.0) is not None:
        engine.announce(now=0.0)
        for i, agent in enumerate(agents):
            engine.accept(dp_completed(engine, agent, seed=i), now=1.0)
        metrics = engine.close(now=1.0, model_wire_bytes=0)
        epsilons.append(metrics.privacy["epsilon"])
        assert set(metrics.aggregation) == {"clip_bound", "noise_std"}  # no per-agent norms under privacy
    assert epsilons == [round(epsilon_of(((2.0, n),), 1e-5), 4) for n in (1, 2)]  # 3.19 then 4.01 > 3.5: stop
    assert engine.finished and engine.budget_exhausted and engine.version == 3
    assert np.linalg.norm(engine.global_vector - before) > 10 * 0.5  # noise of std 2*0.5/3 on every value
    resumed = RoundEngine(config, replay=ReplayGuard(3600))
    assert resumed.ledger.summary()["epsilon"] == epsilons[-1]
    assert resumed.begin_round(agents, now=0.0) is None and resumed.finished


def test_privacy_turned_on_over_models_published_without_it_reports_no_finite_epsilon(tmp_path):
    """Switching ``[privacy]`` off and on cannot launder spent budget: a model published without noise is
    remembered in the checkpoint, and from then on every agent's epsilon is infinite."""
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=5, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3},
                  strategy={"name": "fedavg", "weighting": "uniform"})  # fmt: skip
    plain = load_server_config(layout.server_config)
    agents = ["agent-01", "agent-02", "agent-03"]
    engine = RoundEngine(plain, replay=ReplayGuard(3600))
    engine.begin_round(agents, now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(agents):
        engine.accept(dp_completed(engine, agent, seed=i), now=1.0)
    assert engine.close(now=1.0, model_wire_bytes=0).privacy == {}
    private = dataclasses.replace(plain, privacy=PrivacyPolicy(clip=0.5, noise_multiplier=2.0, target_epsilon=10.0))
    resumed = RoundEngine(private, replay=ReplayGuard(3600))
    assert resumed.ledger.summary()["epsilon"] == math.inf and resumed.ledger.summary()["unprotected_rounds"] == 1
    assert resumed.begin_round([], now=0.0, enrolled=agents) is None and resumed.budget_exhausted  # nobody online


def test_under_privacy_no_update_is_folded_early_and_refusals_say_only_their_kind(tmp_path):
    """Folding an update at accept only when its norm is under the clip would make the round's timing
    (``aggregate_s``) count the clipped updates; refusal reasons carry values measured on an update.
    Under privacy neither reaches the metrics, and an agent refused on its values is charged."""
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=5, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 2},
                  strategy={"name": "fedavg", "weighting": "uniform"},
                  privacy={"clip": 100.0, "noise_multiplier": 1.0})  # fmt: skip
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    engine.begin_round(["agent-01", "agent-02", "agent-03"], now=0.0)
    engine.announce(now=0.0)
    records = [
        engine.accept(dp_completed(engine, agent, seed=i), now=1.0) for i, agent in enumerate(["agent-01", "agent-02"])
    ]
    assert all(r.folded == 0.0 for r in records)  # every update waits for the close, clipped or not
    bad = dp_completed(engine, "agent-03", seed=3)
    poisoned = bytearray(bad.data)  # its last value (the end of the last tensor) becomes NaN
    poisoned[-4:] = np.array([np.nan], np.float32).tobytes()
    with pytest.raises(UpdateRejected):
        engine.accept(dataclasses.replace(bad, data=memoryview(bytes(poisoned))), now=1.0)
    engine.reject("agent-03", "non-finite-values: 1 NaN at features.0.weight[3]")
    metrics = engine.close(now=1.0, model_wire_bytes=0)
    assert metrics.aggregate_s == 0.0 and [r.reason for r in metrics.rejected] == ["non-finite-values"]
    assert engine.ledger.summary()["max_rounds_per_agent"] == 1 and "agent-03" in engine.ledger.charged


def test_spent_agents_neither_start_a_round_nor_stand_in_and_the_run_ends_only_when_enrolled_agents_are_spent(
    tmp_path,
):
    layout = create_federation(tmp_path, SimSettings(agents=6, rounds=10, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3},
                  strategy={"name": "fedavg", "weighting": "uniform"},
                  privacy={"clip": 0.5, "noise_multiplier": 2.0, "target_epsilon": 3.0})  # fmt: skip
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    first, fresh = ["agent-01", "agent-02", "agent-03"], ["agent-04", "agent-05", "agent-06"]

    def run_round(agents: list[str]) -> None:
        engine.announce(now=0.0)
        for i, agent in enumerate(agents):
            engine.accept(dp_completed(engine, agent, seed=i), now=1.0)
        engine.close(now=1.0, model_wire_bytes=0)

    assert engine.begin_round(first, now=0.0, enrolled=first + fresh).selected == first
    run_round(first)  # one round at z = 2 costs 2.17; a second would reach 3.19 > 3
    assert engine.begin_round(first, now=0.0, enrolled=first + fresh) is None  # the fresh ones are offline
    assert not engine.finished  # ... so the run waits for them
    rs = engine.begin_round(first + fresh, now=0.0, enrolled=first + fresh)
    assert rs.selected == fresh
    excused, stand_ins = engine.replace_missing(first + fresh, 0.0)  # a deadline passed: nobody with budget to stand in
    assert stand_ins == [] and excused == []
    run_round(fresh)
    assert engine.begin_round(first + fresh, now=0.0, enrolled=first + fresh) is None and engine.budget_exhausted


def test_settings_that_would_silently_give_no_privacy_or_no_round_at_all_are_refused():
    with pytest.raises(ValueError, match="privacy.clip must be > 0 to turn differential privacy on"):
        PrivacyPolicy(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="privacy.clip must be > 0"):
        PrivacyPolicy(target_epsilon=8.0)
    with pytest.raises(ValueError, match=r"target_epsilon = 2 is below what a single round costs \(epsilon 4.73"):
        PrivacyPolicy(clip=0.5, noise_multiplier=1.0, target_epsilon=2.0)
    PrivacyPolicy(clip=0.5, noise_multiplier=1.0, target_epsilon=4.8)  # one round fits
