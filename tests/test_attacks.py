"""The experiments' attackers do what their names say (sim/attacks.py)."""

import numpy as np
import pytest

from models.weights import to_arrays
from models.zoo import build_model
from sim.attacks import Attack, poisoned


@pytest.fixture
def weights():
    base = to_arrays(build_model("digits_cnn"))
    local = {k: (v + 0.1 if np.issubdtype(v.dtype, np.floating) else v + 3) for k, v in base.items()}
    return base, local


def test_each_attack_changes_the_delta_as_named(weights):
    base, local = weights
    rng = np.random.default_rng(0)
    flipped = poisoned(local, base, Attack.parse("sign-flip"), rng)
    scaled = poisoned(local, base, Attack.parse("scale:100"), rng)
    noise = poisoned(local, base, Attack.parse("noise:1"), rng)
    w = "classifier.0.weight"
    np.testing.assert_allclose(flipped[w] - base[w], -0.1, atol=1e-6)
    np.testing.assert_allclose(scaled[w] - base[w], 10.0, atol=1e-4)
    assert abs(float(np.std(noise[w] - base[w])) - 1.0) < 0.05
    ints = [k for k, v in base.items() if not np.issubdtype(v.dtype, np.floating)]
    assert all(np.array_equal(flipped[k], local[k]) for k in ints)  # counters are not part of a delta


def test_the_parameters_scope_reports_batchnorm_statistics_honestly(weights):
    base, local = weights
    params = {name for name, _ in build_model("digits_cnn").named_parameters()}
    out = poisoned(local, base, Attack.parse("sign-flip"), np.random.default_rng(0), targets=params)
    assert np.array_equal(out["features.1.running_var"], local["features.1.running_var"])
    np.testing.assert_allclose(out["features.1.weight"] - base["features.1.weight"], -0.1, atol=1e-6)


def test_a_claim_can_follow_an_attack_on_the_weights():
    attack = Attack.parse("scale:-20+samples:1e12")
    assert (attack.kind, attack.value, attack.claim) == ("scale", -20.0, 10**12)
    assert str(attack) == "scale:-20+samples:1000000000000"


@pytest.mark.parametrize(
    "spec", ["flip", "scale", "scale:x", "noise:-1", "samples:0", "sign-flip:2", "samples:5+samples:6",
             "silent+samples:9", "scale:2+noise:1"],
)
def test_bad_attack_specs_are_refused(spec):
    with pytest.raises(ValueError, match="--attack"):
        Attack.parse(spec)
