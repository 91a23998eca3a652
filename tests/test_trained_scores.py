"""The trained models' scores (``personal.trained``): each agent's C-SPE of the model it trained, measured by its
trainer on its local test split, and the server's C-GEN of the start model plus the uploaded change, both checked
against an offline evaluation of the same models, in every round of every strategy."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from broker_server.config import load_server_config
from broker_server.rounds.engine import RoundEngine
from broker_server.rounds.evaluation import server_evaluator
from broker_server.rounds.personal import StartScores
from flcore.update import UpdateMeta, UpdateMetaError
from models.datasets import load_npz
from models.training import evaluate_arrays
from models.weights import advanced
from participant.classifier import ClassifierTrainer
from protocol.scores import round_headline
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from sim.run import run_sim
from tests.fedharness import override_toml, round_task
from tests.fixtures import AGENTS, update


@pytest.fixture
def engine_config(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=3, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3})
    return layout


def _engine(layout, **server: object) -> RoundEngine:
    if server:
        override_toml(layout.server_config, server=server)
    config = load_server_config(layout.server_config)
    return RoundEngine(config, replay=ReplayGuard(3600), evaluator=server_evaluator(config))


def _round(engine: RoundEngine, seed: int, scale: float = 30.0) -> dict:
    """One round of three random updates; returns each agent's trained model as the agent holds it."""
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    trained = {}
    for i, agent in enumerate(AGENTS):
        done, delta = update(engine, agent, seed + i, scale=scale)  # 30: far enough apart to score differently
        trained[agent] = advanced(engine.start_model(agent), delta)
        engine.accept(done)
    return trained


def test_the_server_scores_each_trained_model_as_an_offline_evaluation_of_start_plus_upload(engine_config):
    engine = _engine(engine_config)
    offline = server_evaluator(engine.config)
    for seed in (1, 10):  # round 2 starts from round 1's global model
        trained = _round(engine, seed)
        metrics = engine.close(now=1.0, model_wire_bytes=1)
        got = metrics.personal["trained"]
        expected = {a: round(offline(model)["accuracy"], 6) for a, model in trained.items()}
        assert {a: s["c_gen"] for a, s in got["agents"].items()} == expected
        assert got["c_gen"] == pytest.approx(np.mean(list(expected.values())), abs=1e-6)
        assert got["scored"] == 3 and "c_spe" not in got  # these agents reported no trained C-SPE
        assert [s["key"] for s in metrics.headline][-1] == "trained_c_gen"


def test_score_trained_bounds_the_server_evaluations_a_round_and_zero_turns_them_off(engine_config):
    engine = _engine(engine_config, score_trained=1)
    _round(engine, 1)
    got = engine.close(now=1.0, model_wire_bytes=1).personal["trained"]
    assert got["scored"] == 1 and len(got["agents"]) == 1
    engine = _engine(engine_config, score_trained=0, state_dir="state-off")
    _round(engine, 1)
    assert "trained" not in engine.close(now=1.0, model_wire_bytes=1).personal


def test_score_start_bounds_the_start_models_scored_a_round_not_the_published_one(engine_config):
    engine = _engine(engine_config, score_start=0, state_dir="state-global")
    _round(engine, 1, scale=1.0)
    published = engine.close(now=1.0, model_wire_bytes=1).eval["accuracy"]
    _round(engine, 10, scale=1.0)  # everyone starts from the published model: its evaluation costs nothing more
    got = engine.close(now=1.0, model_wire_bytes=1).personal
    assert got["scored"] == 3 and got["c_gen"] == pytest.approx(published, abs=1e-6)
    restarted = _engine(engine_config, score_start=0, state_dir="state-global")  # the published one's score kept
    _round(restarted, 20, scale=1.0)
    assert restarted.close(now=1.0, model_wire_bytes=1).personal["scored"] == 3
    first = _engine(engine_config, score_start=0, state_dir="state-first")
    _round(first, 1, scale=1.0)  # the initial model, never published, is the model in force: scored all the same
    assert first.close(now=1.0, model_wire_bytes=1).personal["scored"] == 3
    override_toml(engine_config.server_config, strategy={"name": "fedamp", "start": "cloud"})  # a model per agent
    for limit in (3, 1):
        engine = _engine(engine_config, score_start=limit, state_dir=f"state-{limit}")
        for seed in (1, 10):  # round 2: every agent starts from its own cloud model
            _round(engine, seed, scale=1.0)
            got = engine.close(now=1.0, model_wire_bytes=1).personal
        assert got["scored"] == limit == sum("c_gen" in a for a in got["agents"].values())


def test_trained_models_are_scored_as_their_uploads_are_accepted_and_the_close_scores_only_the_missing():
    """The sample drawn from the selected agents is scored while the others still train; an agent of it whose upload
    never counts gives its place to the next in the draw, scored at the close."""
    calls: list[str] = []
    scores = StartScores(lambda model: calls.append(model["agent"]) or {"accuracy": 0.5})
    selected = [f"a{i}" for i in range(6)]
    for agent in selected:
        scores.early(4, selected, agent, lambda a: {"agent": a}, limit=2)
    early = sorted(calls)
    assert len(early) == 2
    uploads = [SimpleNamespace(agent=a, trained_eval={}) for a in selected]
    calls.clear()
    assert scores.trained(4, uploads, lambda a: {"agent": a}, limit=2)["scored"] == 2 and calls == []  # all early
    missing = [u for u in uploads if u.agent != early[0]]  # one of the sample never counted
    got = scores.trained(4, missing, lambda a: {"agent": a}, limit=2)
    assert got["scored"] == 2 and len(calls) == 1 and calls[0] not in early  # its place scored at the close
    assert early[1] in got["agents"]
    calls.clear()
    assert scores.trained(5, uploads, lambda a: {"agent": a}, limit=2)["scored"] == 2 and len(calls) == 2  # new round


def test_a_failed_evaluation_on_acceptance_keeps_the_update_and_the_close_scores_it(engine_config, caplog):
    engine = _engine(engine_config, score_trained=3)
    evaluator, failing = engine.start_scores.evaluator, [True]
    engine.start_scores.evaluator = lambda model: (_ for _ in ()).throw(RuntimeError("cuda gone")) if failing[0] \
        else evaluator(model)  # fmt: skip
    _round(engine, 1, scale=1.0)
    assert len(engine.round_state.updates) == 3 and "trained model not scored on acceptance" in caplog.text
    failing[0] = False
    assert engine.close(now=1.0, model_wire_bytes=1).personal["trained"]["scored"] == 3


def test_a_close_tried_again_scores_the_same_start_models():
    """A close whose checkpoint could not be written runs again: the same draw, not ``limit`` more models."""
    calls: list[str] = []
    scores = StartScores(lambda model: calls.append(model["agent"]) or {"accuracy": 0.5})
    start_of = {**{f"a{i}": f"model-{i}" for i in range(6)}, "g": "global-v3"}
    drawn = []
    for _attempt in range(2):
        calls.clear()
        got = scores.personal(4, [], start_of, lambda agent: {"agent": agent}, limit=2)
        assert got["scored"] == 3 and len(calls) == 3 and "g" in calls  # the global model in force and two others
        drawn.append(sorted(calls))
    assert drawn[0] == drawn[1]


@pytest.mark.parametrize("key", ["score_trained", "score_start"])
def test_a_bad_score_bound_fails_at_start_naming_the_key(engine_config, key):
    override_toml(engine_config.server_config, server={key: -1})
    with pytest.raises(Exception, match=f"server.{key} must be a whole number >= 0"):
        load_server_config(engine_config.server_config)


def test_the_trainer_reports_the_trained_model_on_its_test_split(tmp_path, engine_config):
    train = load_npz(engine_config.root / "agent-01" / "data.npz")
    test = load_npz(engine_config.root / "server" / "test.npz")  # any split the agent never trained on
    trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="agent-01", work_dir=tmp_path,
                                test_data=test)  # fmt: skip
    engine = _engine(engine_config)
    model = engine.config.server.model
    result = trainer.train(engine.global_arrays, round_task(model=model, selected=["agent-01"]))
    assert result.trained_eval == evaluate_arrays(model, result.arrays, test, torch.device("cpu"))
    assert result.start_eval == evaluate_arrays(model, engine.global_arrays, test, torch.device("cpu"))
    assert result.trained_eval["accuracy"] != result.start_eval["accuracy"]


def test_the_trained_evaluation_travels_in_the_header_and_is_checked_like_the_start_one():
    meta = UpdateMeta(round=3, base_version=2, samples=10, loss=0.5, trained_eval={"accuracy": 0.9, "loss": 0.2})
    assert UpdateMeta.from_metadata(meta.to_metadata()).trained_eval == {"accuracy": 0.9, "loss": 0.2}
    forged = {**meta.to_metadata(), "trained_eval": json.dumps({f"k{i}": 0.5 for i in range(40)})}
    with pytest.raises(UpdateMetaError, match="trained_eval must be an object of at most 16 numbers"):
        UpdateMeta.from_metadata(forged)


def test_the_headline_pairs_each_start_score_with_its_trained_one():
    personal = {"c_spe": 0.8, "c_gen": 0.5, "trained": {"c_spe": 0.9, "c_gen": 0.4}}
    keys = [s["key"] for s in round_headline("agent", {"accuracy": 0.3}, personal)]
    assert keys == ["c_spe", "trained_c_spe", "c_gen", "trained_c_gen", "accuracy"]
    assert [s["label"] for s in round_headline("global", {"accuracy": 0.3}, personal)][-2:] == [
        "C-GEN", "trained C-GEN"]  # fmt: skip


@pytest.mark.parametrize("strategy", ["fedavg", "demlearn", "fedamp", "ditto", "fedper"])
def test_every_strategys_rows_carry_trained_scores_beside_the_start_ones(tmp_path, strategy):
    settings = SimSettings(agents=4, rounds=2, partition="shards", in_process=True, strategy={"name": strategy},
                           federation="t", dataset="mnist1d")  # fmt: skip
    run_sim(settings, tmp_path / "run", echo=lambda _line: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        trained = row["personal"]["trained"]
        assert set(trained["agents"]) == set(row["accepted"])
        assert all(0 <= a["c_spe"] <= 1 for a in trained["agents"].values())
        if strategy in ("ditto", "fedper"):  # judged by personal models the server never holds: no C-GEN of theirs
            assert trained["scored"] == 0 and "c_gen" not in trained
        else:
            assert trained["scored"] == 4 and all(0 <= a["c_gen"] <= 1 for a in trained["agents"].values())
    # after training on its own two labels, an agent scores better on them than the model it started from
    last = rows[-1]["personal"]
    assert last["trained"]["c_spe"] > last["c_spe"]


def test_prometheus_exports_the_trained_scores_by_key():
    from broker_server.watch.prometheus import ServerMetrics
    from protocol.prometheus import MetricsSection
    from tests.fedharness import round_metrics

    metrics = round_metrics(models="agent", eval={"accuracy": 0.25},
                            personal={"c_spe": 0.875, "c_gen": 0.5, "trained": {"c_spe": 0.9375, "c_gen": 0.375}})
    prometheus = ServerMetrics(MetricsSection())
    prometheus.round_closed(metrics)
    value = prometheus.registry.get_sample_value
    assert value("skyfed_server_round_score", {"score": "trained_c_gen"}) == 0.375
    assert value("skyfed_server_round_score", {"score": "trained_c_spe"}) == 0.9375
