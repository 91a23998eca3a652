"""Feature skew: each agent's own input transformation, its spec, and a federation laid out and run with it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models import feature_skew, partition
from models.datasets import load_npz
from models.feature_skew import FeatureSkew, Transform
from models.mnist1d import load_mnist1d
from sim.classify_layout import Sharing, write_classify_data
from sim.federation import SimSettings
from sim.run import run_sim
from skyfed import main


@pytest.mark.parametrize(
    ("spec", "labels", "features"),
    [
        ("feature-skew", partition.iid, FeatureSkew()),
        ("feature-skew:", partition.iid, FeatureSkew()),
        ("iid+feature-skew:rotate=45,noise=0", partition.iid, FeatureSkew(rotate=45, noise=0)),
        ("dirichlet:0.3+feature-skew:scale=0.5,offset=1", None, FeatureSkew(scale=0.5, offset=1)),
        ("shards:2", None, None),
    ],
)
def test_a_partition_spec_names_its_label_split_and_its_feature_skew(spec, labels, features):
    plan = partition.parse_plan(spec)
    assert plan.features == features
    if labels is not None:
        assert plan.labels is labels


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("feature-skew:rot=30", "option 'rot' is unknown"),
        ("shards:2+feature-skew:scale=1", "option scale=1 is out of range"),
        ("feature-skew:rotate=200", "option rotate=200 is out of range"),
        ("feature-skew:noise=-0.1", "option noise=-0.1 is out of range"),
        ("feature-skew:offset=a", "option offset='a' is not a number"),
        ("feature-skew:noise", "option 'noise' needs one value"),
        ("feature-skew:noise=1,noise=2", "option 'noise' needs one value"),
        ("iid+rotate", "after '+' comes feature-skew"),
        ("shards:x+feature-skew", "partition 'shards:x' is not understood"),
    ],
)
def test_a_bad_feature_skew_spec_is_refused_naming_the_key_and_the_accepted_forms(spec, named):
    with pytest.raises(ValueError, match="rotate=DEGREES") as caught:
        partition.parse_plan(spec)
    assert named in str(caught.value)
    with pytest.raises(ValueError, match="rotate=DEGREES"):  # a sim refuses it before it starts
        SimSettings(partition=spec)


def test_each_agent_draws_its_own_transformation_the_same_every_time():
    spec = FeatureSkew(rotate=90, scale=0.5, offset=1, noise=0.3)
    drawn = [feature_skew.draw(spec, 7, agent) for agent in range(20)]
    assert drawn == [feature_skew.draw(spec, 7, agent) for agent in range(20)]
    assert len({t.angle for t in drawn}) == len({t.gain for t in drawn}) == len({t.shift for t in drawn}) == 20
    assert all(abs(t.angle) <= 90 and 0.5 <= t.gain <= 1.5 and abs(t.shift) <= 1 and 0 <= t.noise <= 0.3
               for t in drawn)  # fmt: skip
    assert drawn != [feature_skew.draw(spec, 8, agent) for agent in range(20)]
    assert feature_skew.draw(FeatureSkew(offset=1, noise=1), 7, 3, unit=2.0).shift == pytest.approx(
        2 * feature_skew.draw(FeatureSkew(offset=1, noise=1), 7, 3).shift)  # fmt: skip


def test_a_transformation_turns_signals_by_phase_and_images_by_angle_then_scales_and_shifts():
    rng = np.random.default_rng(0)
    signals = rng.normal(size=(3, 1, 40)).astype(np.float32)
    turned = feature_skew.apply(signals, Transform(angle=90, gain=2.0, shift=0.5, noise=0), rng)
    np.testing.assert_allclose(turned, 2 * np.roll(signals, 10, axis=-1) + 0.5, rtol=1e-6)
    images = rng.uniform(size=(2, 1, 8, 8)).astype(np.float32)
    quarter = feature_skew.apply(images, Transform(angle=90, gain=1.0, shift=0.0, noise=0), rng)
    assert any(np.allclose(quarter, np.rot90(images, k, axes=(2, 3)), atol=1e-5) for k in (1, 3))
    noisy = feature_skew.apply(signals, Transform(angle=0, gain=1.0, shift=0.0, noise=0.5), rng)
    assert noisy.dtype == np.float32 and 0.4 < float(np.std(noisy - signals)) < 0.6


def test_a_feature_skewed_layout_keeps_the_label_split_and_puts_each_agent_in_its_own_domain(tmp_path):
    """Beside ``shards:2`` the same samples go to the same agents, and an agent's training file and local test
    split both hold them under its own transformation (noise 0 here, so exactly); the server's evaluation
    set holds every agent's transformation on an equal part of MNIST-1D's test split."""
    names = [f"a{i}" for i in range(1, 6)]
    plain, skewed = tmp_path / "plain", tmp_path / "skewed"
    hist = write_classify_data(plain, names, "shards:2", seed=4, dataset="mnist1d")
    spec = "shards:2+feature-skew:rotate=180,scale=0.5,offset=0.5,noise=0"
    skewed_hist = write_classify_data(skewed, names, spec, seed=4, dataset="mnist1d")
    np.testing.assert_array_equal(hist[0], skewed_hist[0])
    np.testing.assert_array_equal(hist[1], skewed_hist[1])
    assert hist[2] == [""] * 5 and len(set(skewed_hist[2])) == 5 and all("rotated" in d for d in skewed_hist[2])
    unit = float(load_mnist1d()[0].x.std())
    for index, name in enumerate(names):
        transform = feature_skew.draw(FeatureSkew(rotate=180, scale=0.5, offset=0.5, noise=0), 4, index, unit)
        assert transform.describe() == skewed_hist[2][index]
        for split in ("data.npz", "test.npz"):
            before, after = load_npz(plain / name / split), load_npz(skewed / name / split)
            np.testing.assert_array_equal(before.y, after.y)
            expected = feature_skew.apply(before.x, transform, np.random.default_rng(0))
            np.testing.assert_allclose(after.x, expected, rtol=1e-5, atol=1e-5)
    before, after = load_npz(plain / "server" / "test.npz"), load_npz(skewed / "server" / "test.npz")
    np.testing.assert_array_equal(before.y, after.y)
    owner = feature_skew.deal(before.y, 5, 4)
    assert np.bincount(owner).tolist() == [200] * 5  # an equal part per agent, each with every label
    assert all(len(np.unique(before.y[owner == agent])) == 10 for agent in range(5))
    for agent in range(5):
        transform = feature_skew.draw(FeatureSkew(rotate=180, scale=0.5, offset=0.5, noise=0), 4, agent, unit)
        rows = owner == agent
        expected = feature_skew.apply(before.x[rows], transform, np.random.default_rng(0))
        np.testing.assert_allclose(after.x[rows], expected, rtol=1e-5, atol=1e-5)


def test_the_same_seed_lays_out_the_same_noisy_files(tmp_path):
    for run in ("one", "two"):
        write_classify_data(tmp_path / run, ["a1", "a2"], "feature-skew:noise=0.5", seed=1, dataset="mnist1d")
    for path in ("a1/data.npz", "a2/test.npz", "server/test.npz"):
        np.testing.assert_array_equal(load_npz(tmp_path / "one" / path).x, load_npz(tmp_path / "two" / path).x)


def test_skyfed_data_lays_out_feature_skewed_digits_and_refuses_a_bad_option_in_one_line(tmp_path, capsys):
    assert main(["data", "digits", "a1", "a2", "--out", str(tmp_path), "--partition", "feature-skew"]) == 0
    out = capsys.readouterr().out
    assert "every agent transformation on an equal part" in out and out.count("rotated") == 2
    assert load_npz(tmp_path / "a2" / "test.npz").x.shape[1:] == (1, 8, 8)
    assert main(["data", "digits", "a1", "--out", str(tmp_path), "--partition", "feature-skew:angle=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "option 'angle' is unknown" in err


def test_an_in_process_federation_learns_on_feature_skewed_digits(tmp_path):
    """A few rounds in process on ``feature-skew`` (IID labels): the rounds commit, the loss falls and the
    accuracy on the server's mixture of domains passes 40 % (3 rounds; plain IID gets 92 %), and the agents'
    C-SPE, on their own domains, is reported."""
    settings = SimSettings(agents=4, rounds=3, model="mlp_digits", partition="feature-skew:rotate=45", epochs=2,
                           lr=0.1, in_process=True, strategy={"name": "fedavg"})  # fmt: skip
    run_sim(settings, tmp_path / "run", echo=lambda _line: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3] and all(r["outcome"] == "committed" for r in rows)
    assert rows[-1]["eval"]["loss"] < rows[0]["eval"]["loss"] and rows[-1]["eval"]["accuracy"] > 0.4
    assert 0 < rows[-1]["personal"]["c_spe"] <= 1


def test_under_unify_the_agents_left_keep_their_own_transformations_and_the_pool_keeps_the_others(tmp_path):
    """Two of four shares go to the server's pool (``unify``): the two agents that still run are described
    with the transformations of their own shares, not of the first two."""
    spec = FeatureSkew(rotate=90, noise=0)
    _, _, domains = write_classify_data(tmp_path, ["a1", "a2"], "iid+feature-skew:rotate=90,noise=0", seed=2,
                                        dataset="mnist1d", sharing=Sharing(4, 0.5, "unify"))  # fmt: skip
    gave = partition.share(partition.iid(load_mnist1d()[0].y, 4, 2), 0.5, "unify", 2).gave_all
    unit = float(load_mnist1d()[0].x.std())
    kept = [agent for agent in range(4) if agent not in gave]
    assert kept != [0, 1]  # seed 2 gives shares 1 and 2 (from 0): a mix-up would show
    assert domains == [feature_skew.draw(spec, 2, agent, unit).describe() for agent in kept]
    assert len(load_npz(tmp_path / "server" / "shared.npz")) == 2000
