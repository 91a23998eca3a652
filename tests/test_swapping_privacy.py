"""Differential privacy with model swapping (docs/privacy.md): each model handed to another agent is a Gaussian
mechanism over its owner's clipped change, each published average one over everyone's; the accountant
charges every agent once per round whose release holds its data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from broker_server.privacy.accountant import epsilon_of
from broker_server.privacy.gaussian import NORM_SLACK, release
from broker_server.privacy.policy import PrivacyPolicy
from flcore.bounds import InfluencePolicy
from models.weights import TensorSpec
from sim.federation import SimSettings
from sim.run import run_sim


def test_a_released_model_carries_gaussian_noise_of_the_given_std_and_no_negative_variance():
    spec = (TensorSpec("w", "F32", (200_000,)), TensorSpec("bn.running_var", "F32", (1000,)))
    model = np.concatenate([np.zeros(200_000, np.float32), np.full(1000, 0.01, np.float32)])
    noised = release(model, 0.3, spec)
    assert np.std(noised[:200_000]) == pytest.approx(0.3, rel=0.01) and abs(np.mean(noised[:200_000])) < 0.003
    assert (noised[200_000:] >= 0).all() and (noised[200_000:] == 0).sum() > 400  # clamped, not re-drawn
    assert not np.array_equal(release(model, 0.3, spec), noised)  # fresh noise every time


def test_swapping_under_dp_releases_each_model_with_z_s_and_charges_once_per_round(tmp_path):
    """4 agents, fedswap h1 = 1, h2 = 2 (swap, average, swap, average) with S = 0.5, z = 1.2: a swap round's
    noise is z·S' on each released model, an average's z·S'/n on the mean; every agent is charged once per
    round, so after round t every agent's epsilon is that of t Gaussian mechanisms with multiplier z."""
    z, clip = 1.2, 0.5
    settings = SimSettings(agents=4, rounds=4, model="mlp_digits", partition="iid", epochs=1, in_process=True,
                           strategy={"name": "fedswap", "h1": 1, "h2": 2, "weighting": "uniform"},
                           privacy={"clip": clip, "noise_multiplier": z})  # fmt: skip
    run_sim(settings, tmp_path / "run", echo=lambda _line: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["action"] for r in rows] == ["swap", "average"] * 2
    released = z * clip * (1 + NORM_SLACK)
    for t, row in enumerate(rows, start=1):
        expected = released if row["action"] == "swap" else released / 4
        assert row["aggregation"]["noise_std"] == pytest.approx(expected, rel=1e-9)
        assert row["privacy"]["epsilon"] == pytest.approx(epsilon_of(((z, t),), 1e-5), abs=1e-4)
        assert row["privacy"]["max_rounds_per_agent"] == t and "pairs" not in row["aggregation"]


@pytest.mark.parametrize(
    "strategy, privacy, message",
    [
        ({"name": "simfedswap", "aggregate": "median", "weighting": "uniform"}, {},
         "privacy needs strategy.aggregate = one of fedavg.* not 'median'"),
        ({"name": "fedswap"}, {}, 'privacy needs strategy.weighting = "uniform"'),
        ({"name": "fedswap", "weighting": "uniform"}, {"adaptive_clip": True},
         "privacy.adaptive_clip does not work with strategy 'fedswap'"),
        # the average rounds' own weighting (``aggregate_options``) would weight by claimed samples (review)
        ({"name": "fedswap", "weighting": "uniform", "aggregate_options": {"weighting": "samples"}}, {},
         'privacy needs strategy.aggregate_options.weighting = "uniform"'),
    ],
)
def test_swapping_configurations_without_a_guarantee_are_refused(strategy, privacy, message):
    policy = PrivacyPolicy(clip=0.5, noise_multiplier=1.0, **privacy)
    with pytest.raises(ValueError, match=message):
        policy.check_compatible(strategy, InfluencePolicy())
