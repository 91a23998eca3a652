"""FedPer (Arivazhagan et al. 2019; docs/strategies.md): the body is FedAvg's, the personal head stays on each agent
(the ``fedper`` recipe) and is never averaged. Over the real broker, in process, under central DP; refused for
peers, detectors, ``elect_best`` and a head that is not the model's last Linear layers."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from broker_server.config import ConfigError, load_server_config
from flcore.strategies import build_strategy
from flcore.strategies.fedper import personal_head
from models.datasets import load_digits
from models.serialization import load_file
from models.training import evaluate
from models.weights import flatten, load_arrays, state_spec, to_arrays
from models.zoo import build_model
from participant.classifier import ClassifierTrainer
from participant.declined import TrainingDeclined
from participant.local_dp import LocalPrivacySection, PrivacyBudget
from participant.recipes import checked_settings
from participant.recipes.fedper import HEAD_FILE
from protocol.messages import TrainSettings
from sim.federation import SimSettings, create_federation
from skyfed import main
from skyfed.api import run_federation
from tests.fedharness import override_toml, round_task
from tests.fixtures import contributions
from tests.fixtures import damage as damage_file

HEAD = ("classifier.2.weight", "classifier.2.bias")  # digits_cnn's last Linear layer


def fedper(**options: object):  # noqa: ANN201
    strategy = build_strategy({"name": "fedper", **options})
    assert strategy.fit_model(lambda: state_spec(build_model("digits_cnn"))) == ""
    return strategy


def fedper_task(round_number: int):  # noqa: ANN201
    plan = fedper().configure_train(TrainSettings(epochs=1), round_number, {})
    return round_task(model="digits_cnn", run_id="r", round=round_number, train=checked_settings(plan.shared))


def test_the_body_is_exactly_fedavgs_and_the_head_keeps_the_global_one_whatever_the_updates_say():
    arrays = {n: a for n, a in to_arrays(build_model("digits_cnn")).items() if a.dtype == np.float32}
    spec = tuple(s for s in state_spec(build_model("digits_cnn")) if s.name in arrays)
    shuffled = tuple(sorted(spec, key=lambda s: s.name))  # a published model lists its tensors by name
    start = flatten(arrays, shuffled)
    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=start.size).astype(np.float32) for _ in range(3)]  # heads included: not followed
    head = np.concatenate([np.full(int(np.prod(s.shape)), s.name in HEAD) for s in shuffled])
    for options in ({}, {"weighting": "uniform"}):
        plain, personal = build_strategy({"name": "fedavg", **options}), fedper(**options)
        for s in (plain, personal):
            s.begin(start, shuffled)
        expected = plain.aggregate(start, contributions(deltas, samples=[10, 30, 60])).global_vector
        result = personal.aggregate(start, contributions(deltas, samples=[10, 30, 60]))
        assert np.array_equal(result.global_vector[~head], expected[~head])  # the body: FedAvg, bit for bit
        assert np.array_equal(result.global_vector[head], start[head]) and head.sum() == 64 * 10 + 10
        assert result.detail["personal_head"] == list(HEAD)
        noisy = personal.average(start, contributions(deltas)).global_vector + 1.0  # central DP: noise, then the step
        stepped = personal.server_step(start, type(result)(noisy)).global_vector
        assert np.array_equal(stepped[head], start[head]) and np.array_equal(stepped[~head], noisy[~head])


def test_the_head_is_kept_on_the_agent_scored_as_c_spe_and_never_uploaded(tmp_path):
    train, test = load_digits(test_fraction=0.5, seed=0)
    test = test.subset(np.arange(200))
    trainer = ClassifierTrainer(train.subset(np.arange(300)), device=torch.device("cpu"), agent_id="a",
                                work_dir=tmp_path, test_data=test)  # fmt: skip
    start = to_arrays(build_model("digits_cnn"))
    first = trainer.train(start, fedper_task(1))
    kept, _ = load_file(tmp_path / HEAD_FILE)
    assert set(kept) == set(HEAD) and all(np.array_equal(first.arrays[n], start[n]) for n in HEAD)  # no head change
    assert all(float(np.abs(kept[n] - start[n]).max()) > 1e-4 for n in HEAD)  # ... though the head trained
    assert float(np.abs(first.arrays["classifier.0.weight"] - start["classifier.0.weight"]).max()) > 1e-4  # body did
    second = trainer.train(first.arrays, fedper_task(2))
    model = build_model("digits_cnn")
    load_arrays(model, {**first.arrays, **kept})
    assert second.start_eval == evaluate(model, test, torch.device("cpu"))  # C-SPE: the round's body, its own head
    load_arrays(model, first.arrays)
    assert second.start_eval != evaluate(model, test, torch.device("cpu"))


def test_under_local_dp_sgd_the_head_trains_privately_and_stays_on_the_agent(tmp_path):
    train, _ = load_digits(test_fraction=0.5, seed=0)
    budget = PrivacyBudget(LocalPrivacySection(noise_multiplier=1.0, max_grad_norm=1.0), tmp_path / "dp.json", 300)
    trainer = ClassifierTrainer(train.subset(np.arange(300)), device=torch.device("cpu"), agent_id="a",
                                work_dir=tmp_path, budget=budget)  # fmt: skip
    start = to_arrays(build_model("mlp_digits"))  # DP-SGD needs a model without BatchNorm
    task = round_task(model="mlp_digits", run_id="r", train=checked_settings(
        build_strategy({"name": "fedper"}).configure_train(TrainSettings(), 1, {}).shared))
    result = trainer.train(start, task)
    kept, _ = load_file(tmp_path / HEAD_FILE)
    assert result.epsilon > 0 and set(kept) == {"net.3.weight", "net.3.bias"}
    assert all(np.array_equal(result.arrays[n], start[n]) and float(np.abs(kept[n] - start[n]).max()) > 1e-4
               for n in kept)  # fmt: skip
    assert float(np.abs(result.arrays["net.1.weight"] - start["net.1.weight"]).max()) > 1e-4


@pytest.mark.parametrize("damage", ["garbage", "nan", "other-layout"])
def test_a_damaged_head_starts_again_from_the_rounds_head(tmp_path, caplog, damage):
    train, _ = load_digits(test_fraction=0.8, seed=0)
    trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path)
    start = to_arrays(build_model("digits_cnn"))
    path = tmp_path / HEAD_FILE
    damage_file(path, damage, {n: start[n] for n in HEAD})
    with caplog.at_level(logging.WARNING, "skyfed.agent"):
        result = trainer.train(start, fedper_task(1))
    assert "personal head" in caplog.text and "starting it from the round's model" in caplog.text
    assert np.isfinite(result.loss) and set(load_file(path)[0]) == set(HEAD)


@pytest.mark.parametrize(("table", "message"), [
    ({"head_layers": 0}, "strategy.head_layers must be a whole number >= 1"),
    ({"head_layers": True}, "strategy.head_layers"),
    ({"head_layers": "1"}, "strategy.head_layers"),
    ({"head": 1}, "strategy.head"),
])  # fmt: skip
def test_bad_options_are_refused_naming_the_key(table, message):
    with pytest.raises(ValueError, match=message):
        build_strategy({"name": "fedper", **table})


def test_the_head_must_be_the_models_last_linear_layers_and_leave_a_body(tmp_path):
    def layout(model: str):  # noqa: ANN202
        return [(s.name, s.shape) for s in state_spec(build_model(model))]

    assert personal_head(layout("digits_cnn"), 2) == ("classifier.0.weight", "classifier.0.bias", *HEAD)
    with pytest.raises(ValueError, match="head_layers = 3: layer 'features.4' is not a Linear layer.*between 1 and 2"):
        personal_head(layout("digits_cnn"), 3)
    with pytest.raises(ValueError, match="head_layers = 2: the model has 2 layers .* leave a shared body.*= 1"):
        personal_head(layout("mlp_digits"), 2)
    strategy = build_strategy({"name": "fedper", "head_layers": 2})
    assert "layer 'features.4' is not a Linear layer" in strategy.fit_model(lambda: state_spec(build_model(
        "mnist1d_cnn")))  # fmt: skip
    train, _ = load_digits(test_fraction=0.8, seed=0)
    trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path)
    task = round_task(model="digits_cnn", run_id="r", train=checked_settings(
        build_strategy({"name": "fedper", "head_layers": 3}).configure_train(TrainSettings(), 1, {}).shared))
    with pytest.raises(TrainingDeclined, match="recipe-refused: strategy.head_layers = 3: layer 'features.4'"):
        trainer.train(to_arrays(build_model("digits_cnn")), task)


def test_the_server_refuses_at_start_what_fedper_cannot_do(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=3, federation="f"), ("127.0.0.1", 1))
    override_toml(layout.server_config, strategy={"name": "fedper", "elect_best": True})
    with pytest.raises(ConfigError, match="strategy.elect_best publishes the global model that evaluated best, and "
                                          "fedper's global model carries no trained head"):  # fmt: skip
        load_server_config(layout.server_config)
    override_toml(layout.server_config, server={"model": "yolov8n", "classes": ["car"]}, strategy={"elect_best": False})
    with pytest.raises(ConfigError, match="strategy fedper keeps Linear head layers on each classifier agent; "
                                          "detectors keep a part with server.share"):  # fmt: skip
        load_server_config(layout.server_config)


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "peer"], "federation.strategy.name 'fedper' does not work between peers: a peer judges and elects"),
    (["--in-process", "--dataset", "mnist1d", "--strategy-option", "head_layers=2"],
     "strategy fedper: strategy.head_layers = 2: layer 'features.4' is not a Linear layer"),
])  # fmt: skip
def test_sim_refuses_fedper_where_it_cannot_run(args, message, capsys, tmp_path):
    code = main(["sim", "--agents", "2", "--rounds", "1", "--strategy", "fedper", "--out", str(tmp_path), *args])
    stderr = capsys.readouterr().err
    assert code == 2 and message in stderr, stderr
    assert "Traceback" not in stderr


def test_fedper_over_the_real_broker_headlines_the_agents_own_heads(tmp_path, broker):
    result = run_federation(SimSettings(agents=3, rounds=2, strategy={"name": "fedper"}, partition="shards:2"),
                            out=tmp_path / "out", broker=broker.address, echo=None)  # fmt: skip
    last = result.metrics[-1]
    assert last.models == "agent" and last.headline[0]["key"] == "c_spe" and last.outcome == "committed"
    assert set(last.personal["agents"]) == {"agent-01", "agent-02", "agent-03"} and len(last.accepted) == 3
    assert "c_gen" not in last.personal  # the server never holds a trained head: no C-GEN under the agents' name
    logs = tmp_path / "out" / "federation" / "logs"
    assert all("personal head kept round=2" in (logs / f"agent-0{i}.log").read_text() for i in (1, 2, 3))
    published, _ = load_file(tmp_path / "out" / "global_model.safetensors")
    torch.manual_seed(0)  # the server's seed: its initial model
    initial = to_arrays(build_model("digits_cnn"))
    assert all(np.array_equal(published[n], initial[n]) for n in HEAD)  # the head never averaged
    assert not np.array_equal(published["classifier.0.weight"], initial["classifier.0.weight"])  # the body was


def test_fedper_in_process_and_under_central_dp(tmp_path):
    plain = run_federation(SimSettings(agents=3, rounds=2, strategy={"name": "fedper"}, in_process=True),
                           out=tmp_path / "plain", echo=None)  # fmt: skip
    assert plain.metrics[-1].personal["c_spe"] > 0 and plain.metrics[-1].headline[0]["key"] == "c_spe"
    private = run_federation(SimSettings(agents=3, rounds=2, in_process=True,
                                         strategy={"name": "fedper", "weighting": "uniform"},
                                         privacy={"clip": 1.0, "noise_multiplier": 0.05}),
                             out=tmp_path / "dp", echo=None)  # fmt: skip
    last = private.metrics[-1]
    assert last.privacy["epsilon"] > 0 and last.outcome == "committed" and len(last.accepted) == 3
    assert last.personal == {}  # the agents' C-SPE is outside the accounting: not published under central DP
