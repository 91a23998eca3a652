"""The round engine without a broker: restarts mid-round, cross-round state, and metrics never lost."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnxruntime
import pytest
import torch

from broker_server.config import load_server_config
from broker_server.rounds.engine import RoundEngine
from flcore.strategies import STRATEGIES
from flcore.strategies.base import RoundResult
from flcore.strategies.fedavg import FedAvg
from flcore.update import NotForThisRound
from models.weights import float_part, load_arrays, ranges_of
from models.zoo import build_model, input_shape
from participant.recipes import work_share
from protocol.messages import RecipeRecord, RoundMetrics
from security.replay import ReplayGuard
from tests.fedharness import override_toml
from tests.fixtures import completed, open_round, random_delta


def run_a_round(engine: RoundEngine, now: float = 1.0) -> RoundMetrics:
    """One round in which the three agents' updates are accepted, closed at ``now``."""
    open_round(engine)
    for i, agent in enumerate(["agent-01", "agent-02", "agent-03"]):
        engine.accept(completed(engine, agent, seed=i))
    return engine.close(now=now, model_wire_bytes=0)

def test_the_states_fields_read_through_the_engine_and_change_only_on_the_state(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(engine)
    assert engine.round_state is engine.state.round_state and engine.version == engine.state.version == 1
    with pytest.raises(AttributeError, match="set state.version"):  # a slip would hide the state behind a copy
        engine.version = 2
    engine.fleet.jump(5, 7)  # a collaborator changes the state: the engine reads the change
    assert (engine.round_state, engine.next_round, engine.version) == (None, 5, 7)


def test_a_restart_mid_round_rereads_the_stored_updates_and_gives_the_same_model(config):
    uninterrupted = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(uninterrupted)
    for i, agent in enumerate(["agent-01", "agent-02", "agent-03"]):
        uninterrupted.accept(completed(uninterrupted, agent, seed=i, samples=100 * (i + 1)))
    expected = uninterrupted.close(now=1.0, model_wire_bytes=0)
    expected_model = {k: v.copy() for k, v in uninterrupted.global_arrays.items()}

    for path in sorted(config.state_dir.iterdir()):  # start over from an empty state
        if path.name in ("checkpoint", "metrics.jsonl", "global_model.safetensors"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    first = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(first)
    for i, agent in enumerate(["agent-01", "agent-02"]):
        first.accept(completed(first, agent, seed=i, samples=100 * (i + 1)))
    resumed = RoundEngine(config, replay=ReplayGuard(3600))  # as after a kill -9: nothing but the files
    assert resumed.round_state.accepted == ["agent-01", "agent-02"]
    assert all(u.folded == 0 for u in resumed.round_state.updates)
    resumed.accept(completed(resumed, "agent-03", seed=2, samples=300))
    metrics = resumed.close(now=1.0, model_wire_bytes=0)
    assert metrics.outcome == expected.outcome == "committed"
    for name, value in expected_model.items():
        np.testing.assert_allclose(resumed.global_arrays[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


class ToyMomentum(FedAvg):
    """FedAvg plus a server momentum vector: state that must outlive a round and a restart."""

    name = "toy-momentum"

    def __init__(self, options=None) -> None:  # noqa: ANN001
        super().__init__(options)
        self.momentum = np.zeros(0, np.float32)

    def aggregate(self, global_vector, contributions):  # noqa: ANN001, ANN201
        step = super().aggregate(global_vector, contributions).global_vector - global_vector
        self._next = (0.5 * self.momentum + step) if self.momentum.size else step
        return type(super().aggregate(global_vector, contributions))(global_vector + self._next)

    def on_commit(self, result) -> None:  # noqa: ANN001
        self.momentum = self._next

    def state(self):  # noqa: ANN201
        return {"momentum": self.momentum}

    def restore(self, state) -> None:  # noqa: ANN001
        self.momentum = state.get("momentum", np.zeros(0, np.float32))


def test_strategy_state_that_lasts_across_rounds_survives_a_restart(config, monkeypatch, request):
    STRATEGIES.add(ToyMomentum.name, ToyMomentum)
    request.addfinalizer(lambda: STRATEGIES.remove(ToyMomentum.name))
    override_toml(config.path, strategy={"name": "toy-momentum"})
    config = load_server_config(config.path)
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    run_a_round(engine)
    momentum = engine.strategy.momentum.copy()
    assert momentum.size and np.abs(momentum).sum() > 0
    restarted = RoundEngine(config, replay=ReplayGuard(3600))
    np.testing.assert_array_equal(restarted.strategy.momentum, momentum)


def test_a_metrics_line_lost_in_a_crash_after_the_checkpoint_is_appended_at_restart(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    run_a_round(engine)
    log = config.state_dir / "metrics.jsonl"
    log.write_text("")  # the crash came between the checkpoint and the append
    RoundEngine(config, replay=ReplayGuard(3600))
    RoundEngine(config, replay=ReplayGuard(3600))  # and a second restart does not append it twice
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["round"], r["outcome"]) for r in rows] == [(1, "committed")]


def test_a_new_run_sets_an_earlier_runs_metrics_aside(config):
    """A state folder whose checkpoint is gone starts a new run, counting its rounds from 1 again: the earlier
    run's lines stayed in metrics.jsonl, mixing both runs in skyfed report and the retained history, and a new
    round 1 was never appended where the old file ended with a round 1 (``reconcile`` took it for written)."""
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    run_a_round(engine)
    log = config.state_dir / "metrics.jsonl"
    earlier = log.read_bytes()
    shutil.rmtree(config.state_dir / "checkpoint")
    again = RoundEngine(config, replay=ReplayGuard(3600))
    assert again.run_id != engine.run_id and not log.exists()
    (kept,) = config.state_dir.glob("metrics-*.jsonl")
    assert kept.read_bytes() == earlier
    run_a_round(again, now=2.0)
    assert [json.loads(line)["round"] for line in log.read_text().splitlines()] == [1] and log.read_bytes() != earlier
    RoundEngine(config, replay=ReplayGuard(3600))  # a restart of this run sets nothing aside
    assert len(list(config.state_dir.glob("metrics-*.jsonl"))) == 1 and log.exists()


def test_the_last_rounds_metrics_are_written_once_a_round_and_an_inline_copy_still_loads(config):
    """The checkpoint is rewritten at every accepted update; the last round's metrics (104 kB of its 260 kB at
    1,000 agents) live in their own file, written when a round closes. A checkpoint that holds them itself, as
    older ones do, still resumes."""
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    run_a_round(engine)
    state_path = config.state_dir / "checkpoint" / "state.json"
    named = json.loads(state_path.read_text())["last_metrics_file"]
    open_round(engine)
    engine.accept(completed(engine, "agent-01", seed=5))
    state = json.loads(state_path.read_text())
    assert state["last_metrics_file"] == named and "last_metrics" not in state  # not written again
    metrics = json.loads((state_path.parent / named).read_text())
    assert metrics["round"] == 1 and metrics["outcome"] == "committed"
    state["last_metrics"] = metrics
    del state["last_metrics_file"]
    state_path.write_text(json.dumps(state))
    assert RoundEngine(config, replay=ReplayGuard(3600)).state.last_metrics == metrics


def test_an_old_checkpoint_format_is_refused_with_what_to_do(config):
    RoundEngine(config, replay=ReplayGuard(3600))
    state = config.state_dir / "checkpoint" / "state.json"
    state.write_text(json.dumps({"next_round": 1}))
    with pytest.raises(ValueError, match="move .* aside to start a new run"):
        RoundEngine(config, replay=ReplayGuard(3600))


class NegativeVariance(FedAvg):
    """A strategy whose output breaks a model invariant that every accepted update kept."""

    name = "negative-variance"

    def begin(self, global_vector, spec) -> None:  # noqa: ANN001
        super().begin(global_vector, spec)
        self.variances = ranges_of(spec, ("running_var",))

    def aggregate(self, global_vector, contributions):  # noqa: ANN001, ANN201
        vector = super().aggregate(global_vector, contributions).global_vector.copy()
        for r in self.variances:
            vector[r.start : r.stop] = -1.0
        return RoundResult(vector)


def test_a_round_whose_aggregate_has_a_negative_running_variance_is_rolled_back(config, monkeypatch, request):
    STRATEGIES.add(NegativeVariance.name, NegativeVariance)
    request.addfinalizer(lambda: STRATEGIES.remove(NegativeVariance.name))
    override_toml(config.path, strategy={"name": "negative-variance"})
    engine = RoundEngine(load_server_config(config.path), replay=ReplayGuard(3600))
    before = {k: v.copy() for k, v in engine.global_arrays.items()}
    metrics = run_a_round(engine)
    assert metrics.outcome == "rolled-back" and metrics.reason.startswith("invalid-running-var")
    assert engine.version == 1 and all(np.array_equal(before[k], v) for k, v in engine.global_arrays.items())


def test_elect_best_publishes_the_best_evaluated_version_at_the_end_of_the_run(config, monkeypatch):
    """SmartFed's election: the version that evaluated best becomes the final global model, also when
    the server died between the last round's checkpoint and the election."""
    config = dataclasses.replace(config, strategy={"name": "fedavg", "elect_best": True},
                                 server=dataclasses.replace(config.server, score_trained=0))  # one score per model
    scores = iter([0.1, 0.5, 0.9, 0.7])  # 0.1: the initial model, which round 1's agents start from (C-GEN)
    engine = RoundEngine(config, replay=ReplayGuard(3600), evaluator=lambda arrays: {"accuracy": next(scores)})
    monkeypatch.setattr(RoundEngine, "_elect_best", lambda self: None)  # dies before electing
    models = {}
    for round_number in (1, 2, 3):
        open_round(engine)
        for i, agent in enumerate(["agent-01", "agent-02", "agent-03"]):
            engine.accept(completed(engine, agent, seed=10 * round_number + i))
        engine.close(now=float(round_number), model_wire_bytes=0)
        models[round_number] = {k: v.copy() for k, v in engine.global_arrays.items()}
    assert engine.finished and engine.version == 4 and not engine.best.elected
    monkeypatch.undo()
    resumed = RoundEngine(config, replay=ReplayGuard(3600))  # the restart finishes the election
    record = dict(resumed.best.record)
    assert record.pop("onnx")["ok"]
    assert record == {"version": 3, "round": 2, "accuracy": 0.9, "elected": True, "published_as": 5}
    assert resumed.version == 5
    assert all(np.array_equal(resumed.global_arrays[k], v) for k, v in models[2].items())
    # the ONNX file offered for on-board inference is the elected model, not the last round's
    x = np.random.default_rng(0).standard_normal((4, *input_shape("digits_cnn"))).astype(np.float32)
    session = onnxruntime.InferenceSession(str(config.state_dir / "global_model.onnx"))
    onnx_out = session.run(None, {session.get_inputs()[0].name: x})[0]
    for round_number, expected in ((2, True), (3, False)):
        model = build_model("digits_cnn").eval()
        load_arrays(model, models[round_number])
        with torch.no_grad():
            assert np.allclose(onnx_out, model(torch.from_numpy(x)).numpy(), atol=1e-4) == expected
    again = RoundEngine(config, replay=ReplayGuard(3600))
    assert again.best.record == resumed.best.record and again.version == 5  # elected once


def test_fedavg_weighs_an_update_by_its_weight_not_its_image_count(config):
    """A detector's update carries its annotated objects as ``weight`` (seed 001's FedAvg weighting) while
    ``samples`` stays its image count: the average must follow the weights."""
    engine = RoundEngine(dataclasses.replace(config, strategy={"name": "fedavg"}), replay=ReplayGuard(3600))
    before = float_part(engine.global_arrays)
    open_round(engine)
    weights = {"agent-01": 1, "agent-02": 2, "agent-03": 2}  # within the default cap (among three: the median)
    for i, (agent, weight) in enumerate(weights.items()):
        engine.accept(completed(engine, agent, seed=i, samples=100, weight=weight))
    metrics = engine.close(now=1.0, model_wire_bytes=0)
    assert metrics.outcome == "committed" and not metrics.aggregation["capped"]
    deltas = [random_delta(engine, i) for i in range(3)]
    for name, value in before.items():
        expected = value + sum(w * d[name] for w, d in zip(weights.values(), deltas, strict=True)) / 5
        np.testing.assert_allclose(engine.global_arrays[name], expected, atol=1e-6)


def test_an_update_for_a_closed_round_between_rounds_is_refused_as_late(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(engine)
    slow = completed(engine, "agent-03", seed=3)
    for i, agent in enumerate(["agent-01", "agent-02"]):
        engine.accept(completed(engine, agent, seed=i))
    engine.round_state.missed.append("agent-03")  # excused: the round closes without it
    engine.close(now=1.0, model_wire_bytes=0)
    with pytest.raises(NotForThisRound, match="late: round 1 is closed"):
        engine.accept(slow)


def test_fedprox_partial_work_asks_a_slow_agent_for_less_and_remembers_paces_across_a_restart(config):
    """The server times each agent itself (round start to accepted update). With ``partial_work`` an
    agent slower than the median gets work = median pace / its pace in the next round's plan, which the
    task carries and metrics report; the paces survive a restart."""
    config = dataclasses.replace(config, strategy={"name": "fedprox", "partial_work": True, "min_work": 0.1})
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(engine)
    assert engine.round_state.agent_train == {}  # nobody timed yet: full work for all
    for i, (agent, at) in enumerate([("agent-01", 1.0), ("agent-02", 2.0), ("agent-03", 10.0)]):
        engine.accept(completed(engine, agent, seed=i), now=at)
    engine.close(now=10.0, model_wire_bytes=0)
    resumed = RoundEngine(config, replay=ReplayGuard(3600))
    paces = {"agent-01": 1.0, "agent-02": 2.0, "agent-03": 10.0}
    assert resumed.state.pace.of(["agent-01", "agent-02", "agent-03"]) == paces
    open_round(resumed)
    slow = resumed.train_of("agent-03").recipes
    assert slow == (RecipeRecord("proximal", {"mu": 0.01}), RecipeRecord("partial-work", {"share": 0.2}))
    assert work_share(resumed.train_of("agent-01")) == 1.0 and list(resumed.round_state.agent_train) == ["agent-03"]
    for i, (agent, at) in enumerate([("agent-01", 1.0), ("agent-02", 2.0), ("agent-03", 2.0)]):
        resumed.accept(completed(resumed, agent, seed=i), now=at)
    assert resumed.state.pace.of(["agent-03"]) == {"agent-03": 10.0}  # 2 s for a fifth of the work: as slow as before
    metrics = resumed.close(now=2.0, model_wire_bytes=0)
    assert metrics.aggregation["work"] == {"agent-03": 0.2}
