"""The signed recipe record (docs/architecture.md, "Recipes"): what a strategy adds to local training travels as
(name, version, options), checked by the recipe's own options class before the server signs and before a
participant trains; a participant that cannot follow one declines the round naming it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from broker_server.config import ConfigError, load_server_config
from flcore.strategies import STRATEGIES, build_strategy
from flcore.strategies.base import TrainPlan, asking
from flcore.strategies.fedavg import FedAvg
from models.datasets import load_digits
from models.weights import to_arrays
from models.zoo import build_model
from participant.classifier import ClassifierTrainer
from participant.declined import TrainingDeclined
from participant.recipes import RECIPES, checked, checked_settings, recipes_for, refusal, work_share
from protocol.messages import RecipeRecord, RoundTask, TrainSettings
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml, round_task


def test_every_registered_recipe_loads_and_declares_its_trainers():
    for name, recipe in RECIPES.items():
        assert recipe.name == name and recipe.trainers <= {"classifier", "detector"} and recipe.version >= 1
        recipe(recipe.Options())  # its defaults validate


def test_the_server_stamps_the_version_and_refuses_bad_options_naming_the_key():
    assert checked(RecipeRecord("proximal", {"mu": 0.5}, version=0)) == RecipeRecord("proximal", {"mu": 0.5}, 1)
    with pytest.raises(ValueError, match="mu must be >= 0"):
        checked(RecipeRecord("proximal", {"mu": -1.0}))
    with pytest.raises(ValueError, match=r"recipe proximal\.mux"):  # an unknown option: strict, the key named
        checked(RecipeRecord("proximal", {"mux": 1.0}))
    with pytest.raises(ValueError, match="recipe 'telepathy' is unknown"):
        checked(RecipeRecord("telepathy"))


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (RecipeRecord("telepathy", {}), "recipe 'telepathy' is not one this SkyFed has"),
        (RecipeRecord("proximal", {"mu": 0.1}, version=2), "recipe 'proximal' version 2 is not this SkyFed's"),
        (RecipeRecord("proximal", {"mu": "much"}), r"recipe proximal\.mu has the wrong type"),
        (RecipeRecord("partial-work", {"share": 0.0}), r"recipe partial-work: share must be in \(0, 1\]"),
    ],
)
def test_a_participant_declines_a_recipe_it_cannot_follow_naming_it(tmp_path, record, reason):
    train, _ = load_digits(test_fraction=0.9, seed=0)
    trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path)
    task = round_task(model="mlp_digits", run_id="r", train=TrainSettings(recipes=(record,)))
    with pytest.raises(TrainingDeclined, match=f"recipe-refused: {reason}"):
        trainer.train(to_arrays(build_model("mlp_digits")), task)


def test_a_detector_refuses_classifier_recipes_and_follows_partial_work():
    assert refusal(RecipeRecord("proximal", {"mu": 0.1}), "detector") == (
        "recipe 'proximal' needs a classifier trainer, not a detector")
    assert [r.name for r in recipes_for(TrainSettings(recipes=(RecipeRecord("partial-work", {"share": 0.5}),)),
                                        "detector")] == ["partial-work"]  # fmt: skip


def test_recipes_survive_the_signed_task_round_trip_and_order_is_kept():
    plan = build_strategy({"name": "fedamn", "prox_mu": 0.2}).configure_train(TrainSettings(), 1, {})
    settings = checked_settings(plan.shared)
    assert [r.name for r in settings.recipes] == ["attention", "proximal"]
    task = round_task(train=settings)
    again = RoundTask.from_json(json.dumps(task.to_dict()).encode())
    assert again.train == settings and again.train.recipes[1].options == {"mu": 0.2}


def test_a_forged_recipe_list_that_names_one_recipe_twice_is_refused():
    with pytest.raises(ValueError, match="name each recipe once"):
        TrainSettings(recipes=(RecipeRecord("proximal"), RecipeRecord("proximal")))


def test_partial_work_share_is_read_from_the_recipe_and_a_bad_one_counts_as_full_work():
    assert work_share(TrainSettings(recipes=(RecipeRecord("partial-work", {"share": 0.25}),))) == 0.25
    assert work_share(TrainSettings()) == 1.0
    assert work_share(TrainSettings(recipes=(RecipeRecord("partial-work", {"share": 7.0}),))) == 1.0


def test_the_proximal_recipe_changes_what_the_classifier_trains(tmp_path):
    train, _ = load_digits(test_fraction=0.8, seed=0)
    start = to_arrays(build_model("mlp_digits"))
    moved = {}
    for mu in (0.0, 50.0):
        trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path / str(mu))
        settings = TrainSettings(epochs=2, recipes=(RecipeRecord("proximal", {"mu": mu}),))
        arrays = trainer.train(start, round_task(model="mlp_digits", run_id="r", train=settings)).arrays
        moved[mu] = sum(float(np.square(arrays[n] - start[n]).sum()) for n in start)
    assert moved[50.0] < 0.5 * moved[0.0], moved


class DetectingProx(FedAvg):
    """Declares detectors, yet asks for a recipe only the classifier trainer follows."""

    name = "toy-detecting-prox"

    def configure_train(self, settings, round_number, paces):  # noqa: ANN001, ANN201
        return TrainPlan(asking(settings, "proximal", mu=0.1))


def test_a_strategy_whose_recipe_its_task_cannot_follow_is_refused_at_start(tmp_path, request):
    """The recipes are checked against the model's trainer whatever the strategy declares: every agent would
    otherwise decline every round."""
    STRATEGIES.add(DetectingProx.name, DetectingProx)
    request.addfinalizer(lambda: STRATEGIES.remove(DetectingProx.name))
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="d"), ("127.0.0.1", 1))
    override_toml(layout.server_config, server={"model": "yolov8n", "classes": ["car"]},
                  strategy={"name": DetectingProx.name})  # fmt: skip
    with pytest.raises(ConfigError, match="strategy toy-detecting-prox: recipe 'proximal' needs a classifier trainer, "
                       "not a detector: choose another strategy or a classifier model"):  # fmt: skip
        load_server_config(layout.server_config)
