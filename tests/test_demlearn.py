"""DemLearn (seed 000) on the strategy hook that decides what every agent starts from: the hierarchy and its
group models by hand, the engine's per-agent starts and a restart, and a real federation over mosquitto."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from broker_server.rounds.engine import RoundEngine
from flcore.strategies import build_strategy
from flcore.strategies.demlearn import cluster_paths, distance_matrix, group_mixing
from models.weights import advanced, flatten, float_part
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import Federation, override_toml
from tests.fixtures import update
from tests.liveharness import Recording, identical, record_local_models

AGENTS = ["agent-01", "agent-02", "agent-03", "agent-04"]


def test_group_models_by_hand_for_a_fixed_tree():
    """levels = 2: a alone under (0, 0), b under (0, 1), c and d under (1, 0). A level-1 group model is
    (1 − α)·its members' mean + α·(1 − α)·its parent's members' mean + α²·the mean of all."""
    alpha = 0.6
    groups, mixing = group_mixing([(0, 0), (0, 1), (1, 0), (1, 0)], alpha)
    assert groups == [(0, 0), (0, 1), (1, 0)]
    a, p, r = 1 - alpha, alpha * (1 - alpha), alpha**2  # own group, parent, root
    np.testing.assert_allclose(mixing[0], [a + p / 2 + r / 4, p / 2 + r / 4, r / 4, r / 4])
    np.testing.assert_allclose(mixing[2], [r / 4, r / 4, a / 2 + p / 2 + r / 4, a / 2 + p / 2 + r / 4])
    np.testing.assert_allclose(mixing.sum(axis=1), 1.0)  # every group model is an average of models
    _, plain = group_mixing([(0, 0), (0, 1), (1, 0), (1, 0)], 0.0)  # α = 0: each group its members' mean
    np.testing.assert_allclose(plain, [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0.5, 0.5]])


def test_clustering_splits_far_groups_first_and_a_short_branch_goes_on_alone():
    points = np.array([[0, 0], [0, 0.1], [5, 5], [5, 5.1], [5.05, 5.0]], np.float64)
    euclid = distance_matrix(points @ points.T, "euclidean")
    np.testing.assert_allclose(euclid[0, 2], np.hypot(5, 5))
    paths = cluster_paths(euclid, levels=2)
    assert paths[0][0] == paths[1][0] != paths[2][0] == paths[3][0] == paths[4][0]
    assert len({paths[0], paths[1]}) == 2  # the near pair split at level 1
    assert cluster_paths(euclid[:1, :1], levels=3) == [(0, 0, 0)]
    cosine = distance_matrix(np.array([[1.0, 0.0], [0.0, 1.0]]), "cosine")
    np.testing.assert_allclose(cosine, [[0, 1], [1, 0]])


@pytest.fixture
def config(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=4, rounds=3, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 4, "quorum": 4}, bounds={"clip": "off"},
                  strategy={"name": "demlearn", "levels": 1, "tau": 2, "alpha": 0.5})  # fmt: skip
    return load_server_config(layout.server_config)


def test_each_agent_starts_from_its_group_model_and_a_restart_keeps_the_tree(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    # the PLP's proximal term toward the start model
    assert list(engine.round_state.train["recipes"]) == [{"name": "proximal", "options": {"mu": 0.002}, "version": 1}]
    held = {}
    for i, agent in enumerate(AGENTS):
        done, delta = update(engine, agent, seed=i % 2, scale=1 + 0.1 * (i // 2))  # two kinds of agents
        held[agent] = advanced(engine.start_model(agent), delta)
        engine.accept(done)
    first = engine.close(now=1.0, model_wire_bytes=1000)
    assert first.outcome == "committed" and engine.version == 2  # the root is published every round
    spec = engine.float_spec
    vectors = {a: flatten(float_part(m), spec) for a, m in held.items()}
    np.testing.assert_allclose(engine.global_vector, np.mean(list(vectors.values()), axis=0), rtol=1e-6, atol=1e-7)
    groups = {g["group"]: g["members"] for g in first.aggregation["groups"]}
    assert sorted(groups.values()) == [["agent-01", "agent-03"], ["agent-02", "agent-04"]]  # by their direction
    for members in groups.values():  # level 1 under the root: (1 − α)·group mean + α·mean of all
        expected = 0.5 * np.mean([vectors[m] for m in members], axis=0) + 0.5 * engine.global_vector
        for agent in members:
            assert engine.assignments[agent].source == "inbox"
            np.testing.assert_allclose(engine.base_vector(agent), expected, rtol=1e-5, atol=1e-6)
        assert engine.assignments[members[0]] == engine.assignments[members[1]]

    resumed = RoundEngine(config, replay=ReplayGuard(3600))  # a restart between rounds: same tree, same starts
    assert resumed.assignments == engine.assignments and resumed.strategy.tree == engine.strategy.tree
    resumed.begin_round(AGENTS, now=2.0)
    resumed.announce(now=2.0)
    for i, agent in enumerate(AGENTS):  # round 2: the other way round, but tau = 2 keeps the tree
        done, _ = update(resumed, agent, seed=i // 2, scale=1.0)  # the other grouping, had it re-clustered
        resumed.accept(done)
    second = resumed.close(now=3.0, model_wire_bytes=1000)
    assert {g["group"]: g["members"] for g in second.aggregation["groups"]} == groups
    assert second.aggregation["reclustered"] is False and first.aggregation["reclustered"] is True


def test_bad_options_name_the_key():
    with pytest.raises(ValueError, match="strategy.alpha must be in"):
        build_strategy({"name": "demlearn", "alpha": 1.5})
    with pytest.raises(ValueError, match="strategy.distance 'manhattan' must be one of euclidean, cosine"):
        build_strategy({"name": "demlearn", "distance": "manhattan"})


@pytest.mark.timeout(300)
def test_over_a_real_broker_each_agent_trains_round_2_from_its_group_model(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=2, agents=4, partition="shards")
    override_toml(fed.layout.server_config, rounds={"quorum": 4},
                  strategy={"name": "demlearn", "levels": 1, "alpha": 0.5})  # fmt: skip
    locals_by_agent = {}
    for agent in fed.agents:
        agent.runner.trainer = Recording(agent.runner.trainer)
        locals_by_agent[agent.id] = record_local_models(agent)
    fed.run(Aggregator(load_server_config(fed.layout.server_config)), timeout_s=180)
    metrics = fed.metrics()
    assert [len(m.accepted) for m in metrics] == [4, 4] and [m.model_version for m in metrics] == [2, 3]
    groups = [g["members"] for g in metrics[0].aggregation["groups"]]
    bases = {a.id: a.runner.trainer.bases[2] for a in fed.agents}

    def floats(arrays) -> np.ndarray:  # noqa: ANN001
        return np.concatenate([v.ravel() for _, v in sorted(float_part(arrays).items())]).astype(np.float64)

    everyone = np.mean([floats(locals_by_agent[a][0]) for a in locals_by_agent], axis=0)  # the root
    for members in groups:
        expected = 0.5 * np.mean([floats(locals_by_agent[m][0]) for m in members], axis=0) + 0.5 * everyone
        for agent in members:
            np.testing.assert_allclose(floats(bases[agent]), expected, rtol=1e-5, atol=1e-6)
        assert all(identical(bases[members[0]], bases[m]) for m in members)  # one group model, bit for bit
    assert not identical(bases[groups[0][0]], bases[groups[1][0]])


def test_a_rolled_back_rounds_clustering_is_never_installed(config):
    """tau = 2: round 3 re-clusters but is rolled back after ``plan_starts`` (its evaluation is not finite);
    round 4 is not due and keeps round 1's tree, which must stay the tree it commits."""
    failing = {"now": False}
    config = dataclasses.replace(config, server=dataclasses.replace(config.server, rounds=4))
    engine = RoundEngine(config, replay=ReplayGuard(3600),
                         evaluator=lambda _arrays: {"accuracy": float("nan") if failing["now"] else 0.5})
    for number in (1, 2, 3, 4):
        failing["now"] = number == 3
        engine.begin_round(AGENTS, now=0.0)
        engine.announce(now=0.0)
        for i, agent in enumerate(AGENTS):  # round 3 alone would group the agents the other way
            engine.accept(update(engine, agent, seed=i // 2 if number == 3 else i % 2, scale=1 + 0.1 * (i // 2))[0])
        metrics = engine.close(now=1.0, model_wire_bytes=1000)
        assert metrics.outcome == ("rolled-back" if number == 3 else "committed")
        if number == 1:
            tree = dict(engine.strategy.tree)
    assert metrics.aggregation["reclustered"] is False
    assert engine.strategy.tree == tree


def test_amplification_leaves_the_batchnorm_statistics_alone(tmp_path):
    """×1.15 extrapolates each group model's change from the global model: a running variance that fell from
    1 to 0.05 in the round would start the next at 1 − 1.15·0.95 < 0, and the agents' BatchNorm give NaN."""
    layout = create_federation(tmp_path, SimSettings(agents=4, rounds=3, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 4, "quorum": 4}, bounds={"clip": "off"},
                  strategy={"name": "demlearn", "levels": 1, "amplify": 1.15})  # fmt: skip
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    names = [s.name for s in engine.float_spec if s.name.endswith("running_var")]
    assert names and all((engine.global_arrays[n] == 1).all() for n in names)  # BatchNorm's initial variance
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    held = {}
    for i, agent in enumerate(AGENTS):
        done, delta = update(engine, agent, seed=i, fill={name: -0.95 for name in names})
        held[agent] = advanced(engine.start_model(agent), delta)
        engine.accept(done)
    weight = next(s.name for s in engine.float_spec if s.name.endswith("weight"))
    before = engine.global_arrays[weight].copy()
    metrics = engine.close(now=1.0, model_wire_bytes=1000)
    mean = lambda agents: np.mean([held[a][weight] for a in agents], axis=0)  # noqa: E731
    for members in (g["members"] for g in metrics.aggregation["groups"]):
        mixed = 0.4 * mean(members) + 0.6 * mean(AGENTS)  # α = 0.6 toward the root
        for agent in members:
            start = engine.start_model(agent)
            np.testing.assert_allclose(start[weight], before + 1.15 * (mixed - before), rtol=1e-4, atol=1e-6)
            for name in names:
                np.testing.assert_allclose(start[name], 0.05, rtol=1e-5)  # the members' mean, not extrapolated


def test_the_rounds_aggregate_time_includes_the_clustering(tmp_path, monkeypatch):
    """``aggregate_s`` is the strategy's time at the close: DemLearn's clustering runs in ``plan_starts``."""
    import time as clock

    from flcore.strategies.demlearn import DemLearn

    plan = DemLearn.plan_starts

    def slow(self, models):  # noqa: ANN001, ANN202
        clock.sleep(0.2)
        return plan(self, models)

    monkeypatch.setattr(DemLearn, "plan_starts", slow)
    layout = create_federation(tmp_path, SimSettings(agents=2, rounds=1, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 2, "quorum": 2}, strategy={"name": "demlearn"})
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    engine.begin_round(AGENTS[:2], now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(AGENTS[:2]):
        engine.accept(update(engine, agent, seed=i)[0])
    assert engine.close(now=1.0, model_wire_bytes=0).aggregate_s >= 0.2


def test_every_round_reclustering_takes_the_mean_and_the_distances_from_one_pass(tmp_path, monkeypatch):
    """tau = 1 (the default): ``aggregate``'s pass over the kept models gives the published mean and the Gram
    matrix the clustering needs, so ``plan_starts`` reads the models once more (to mix the groups), not twice."""
    from flcore import strategies
    from flcore.agent_models import ModelBank
    from flcore.strategies import demlearn, krum
    from flcore.strategies.base import Contribution, KeptModels, mean_of_models
    from models.weights import TensorSpec

    spec = (TensorSpec("w", "float32", (5000,)),)
    rng = np.random.default_rng(4)
    kinds = [rng.standard_normal(5000, dtype=np.float32) for _ in range(2)]
    bank = ModelBank(tmp_path)
    kept = {f"a{i}": bank.writer(1, f"a{i}", spec, {}).keep(kinds[i % 2] + rng.standard_normal(5000, dtype=np.float32)
                                                            * np.float32(0.1)) for i in range(6)}  # fmt: skip
    views = [Contribution(a, bank.vector(h), 1.0, 1.0, 0.0, model=bank.vector(h)) for a, h in kept.items()]
    models = KeptModels(round=1, action="group", agents=list(kept), kept=kept, exact=set(kept), current={},
                        spec=spec, vector=bank.vector, writer=bank.new_models(1, spec, {}),
                        peers=lambda holdings: bank.peers(holdings, spec), rng=lambda: np.random.default_rng(1))
    passes = []
    gram = demlearn.gram_matrix
    for module in (demlearn, krum):  # plan_starts' own pass, and aggregate's (krum.mean_and_gram)
        monkeypatch.setattr(module, "gram_matrix", lambda *a, **k: (passes.append(k), gram(*a, **k))[1])
    start = np.zeros(5000, np.float32)
    # tau = 2: a round with the tree's agents re-clusters only when due (round 3), from plan_starts' own pass
    for tau, rounds in ((1, {1: [True], 2: [True]}), (2, {1: [True], 2: [], 3: [False]})):
        strategy = strategies.build_strategy({"name": "demlearn", "levels": 1, "tau": tau})
        for number, expected in rounds.items():
            passes.clear()
            result = strategy.aggregate(start, views)
            plan = strategy.plan_starts(dataclasses.replace(models, round=number))
            strategy.on_commit(result)
            assert ["means" in p for p in passes] == expected, (tau, number)
            np.testing.assert_allclose(result.global_vector, mean_of_models(start, views, np.ones(6)), rtol=1e-6,
                                       atol=1e-6)  # fmt: skip
            groups = {a: plan.starts[a].model for a in kept}  # the two kinds, each its own group
            assert groups["a0"] == groups["a2"] == groups["a4"] != groups["a1"] == groups["a3"] == groups["a5"]
