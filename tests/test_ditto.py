"""Ditto (Li et al., ICML 2021; docs/strategies.md): FedAvg's server half and a client recipe that keeps a personal
model pulled toward the global one. Over the real broker, in process, under central DP and between peers."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from broker_server.config import ConfigError, load_server_config
from flcore.strategies import build_strategy
from models.datasets import load_digits
from models.serialization import load_file
from models.training import evaluate
from models.weights import load_arrays, to_arrays
from models.zoo import build_model
from participant.classifier import ClassifierTrainer
from participant.recipes import checked_settings
from participant.recipes.ditto import PERSONAL_FILE
from protocol.messages import TrainSettings
from sim.federation import SimSettings, create_federation
from skyfed.api import run_federation
from tests.fedharness import override_toml, round_task
from tests.fixtures import damage as damage_file


def ditto_task(round_number: int, lam: float = 0.1, epochs: int = 1):  # noqa: ANN201
    plan = build_strategy({"name": "ditto", "lam": lam}).configure_train(TrainSettings(epochs=epochs), round_number, {})
    return round_task(model="mlp_digits", run_id="r", round=round_number, train=checked_settings(plan.shared))


def test_the_personal_model_is_kept_scored_as_c_spe_and_never_uploaded(tmp_path):
    train, test = load_digits(test_fraction=0.5, seed=0)
    trainer = ClassifierTrainer(train.subset(np.arange(300)), device=torch.device("cpu"), agent_id="a",
                                work_dir=tmp_path, test_data=test.subset(np.arange(200)))  # fmt: skip
    start = to_arrays(build_model("mlp_digits"))
    first = trainer.train(start, ditto_task(1))
    personal, _ = load_file(tmp_path / PERSONAL_FILE)
    assert max(float(np.abs(personal[n] - first.arrays[n]).max()) for n in personal) > 1e-3  # two models, not one
    second = trainer.train(first.arrays, ditto_task(2))
    model = build_model("mlp_digits")
    load_arrays(model, personal)
    assert second.start_eval == evaluate(model, test.subset(np.arange(200)), torch.device("cpu"))  # C-SPE: personal
    global_model = build_model("mlp_digits")
    load_arrays(global_model, first.arrays)
    assert second.start_eval != evaluate(global_model, test.subset(np.arange(200)), torch.device("cpu"))


def test_lambda_pulls_the_personal_model_toward_the_global_one(tmp_path):
    train, _ = load_digits(test_fraction=0.8, seed=0)
    start = to_arrays(build_model("mlp_digits"))
    distance = {}
    for lam in (0.0, 5.0):  # lr·λ = 0.25: a stable pull (lr·λ > 2 diverges)
        trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path / str(lam))
        trainer.train(start, ditto_task(1, lam=lam, epochs=2))
        personal, _ = load_file(tmp_path / str(lam) / PERSONAL_FILE)
        distance[lam] = sum(float(np.square(personal[n] - start[n]).sum()) for n in start)
    assert distance[5.0] < 0.2 * distance[0.0], distance


@pytest.mark.parametrize("damage", ["garbage", "nan", "other-layout"])
def test_a_damaged_personal_model_starts_again_from_the_round_model(tmp_path, caplog, damage):
    train, _ = load_digits(test_fraction=0.8, seed=0)
    trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path)
    start = to_arrays(build_model("mlp_digits"))
    path = tmp_path / PERSONAL_FILE
    damage_file(path, damage, start)
    with caplog.at_level(logging.WARNING, "skyfed.agent"):
        result = trainer.train(start, ditto_task(1))
    assert "starting it from the round's model" in caplog.text and np.isfinite(result.loss)
    personal, _ = load_file(path)
    assert set(personal) == set(start) and all(np.isfinite(a).all() for a in personal.values())


def test_ditto_over_the_real_broker_headlines_the_personal_models(tmp_path, broker):
    result = run_federation(SimSettings(agents=3, rounds=2, strategy={"name": "ditto"}, partition="shards:2"),
                            out=tmp_path / "out", broker=broker.address, echo=None)  # fmt: skip
    last = result.metrics[-1]
    assert last.models == "agent" and last.headline[0]["key"] == "c_spe"
    assert set(last.personal["agents"]) == {"agent-01", "agent-02", "agent-03"}
    assert "c_gen" not in last.personal  # the server never sees the personal models: no C-GEN under their name
    logs = tmp_path / "out" / "federation" / "logs"
    assert all("personal model trained round=2" in (logs / f"agent-0{i}.log").read_text() for i in (1, 2, 3))


def test_ditto_in_process_and_under_central_dp(tmp_path):
    plain = run_federation(SimSettings(agents=3, rounds=2, strategy={"name": "ditto"}, in_process=True),
                           out=tmp_path / "plain", echo=None)  # fmt: skip
    assert plain.metrics[-1].personal["c_spe"] > 0
    private = run_federation(SimSettings(agents=3, rounds=2, in_process=True,
                                         strategy={"name": "ditto", "weighting": "uniform"},
                                         privacy={"clip": 1.0, "noise_multiplier": 0.05}),
                             out=tmp_path / "dp", echo=None)  # fmt: skip
    last = private.metrics[-1]
    assert last.privacy["epsilon"] > 0 and last.outcome == "committed" and len(last.accepted) == 3
    # the agents' C-SPE is a score of their own data outside the accounting: not published under central DP
    assert last.personal == {} and last.headline[0]["key"] == "accuracy"


def test_ditto_between_peers(tmp_path, broker):
    result = run_federation(SimSettings(agents=3, rounds=2, mode="peer", strategy={"name": "ditto"}),
                            out=tmp_path / "peers", broker=broker.address, echo=None)  # fmt: skip
    assert {row["round"] for row in result.peer_rounds} == {1, 2}
    logs = tmp_path / "peers" / "federation" / "logs"
    assert all("personal model trained round=2" in p.read_text() for p in logs.glob("agent-*.log"))


def test_ditto_with_a_detector_fails_at_start_naming_the_recipe(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="d"), ("127.0.0.1", 1))
    override_toml(layout.server_config, server={"model": "yolov8n", "classes": ["car"]}, strategy={"name": "ditto"})
    with pytest.raises(ConfigError, match="strategy ditto trains each agent.s personal model with a proximal pull"):
        load_server_config(layout.server_config)
