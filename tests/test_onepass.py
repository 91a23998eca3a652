"""The one-pass check-norm-fold kernel: exact norm, fold only within the bound, never half done."""

import math

import numpy as np
import pytest

from flcore.onepass import BLOCK, Fold, NonFiniteUpdate, scan


def test_norm_and_fold_match_numpy_across_blocks():
    rng = np.random.default_rng(0)
    delta = rng.standard_normal(3 * BLOCK + 7).astype(np.float32)
    acc = rng.standard_normal(delta.size).astype(np.float32)
    expected = acc + 0.5 * delta
    result = scan(delta, Fold(acc, 0.5, math.inf))
    assert result.folded
    assert result.norm == pytest.approx(float(np.linalg.norm(delta.astype(np.float64))), rel=1e-5)
    np.testing.assert_allclose(acc, expected, rtol=1e-6)


def test_an_update_over_the_bound_is_measured_but_leaves_the_sum_as_it_was():
    rng = np.random.default_rng(1)
    delta = rng.standard_normal(4 * BLOCK).astype(np.float32)
    acc = rng.standard_normal(delta.size).astype(np.float32)
    before = acc.copy()
    bound = float(np.linalg.norm(delta[: 2 * BLOCK]))  # crossed in the third block, after two were folded
    result = scan(delta, Fold(acc, 3.0, bound))
    assert not result.folded and result.norm > bound
    np.testing.assert_allclose(acc, before, atol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 3e38])
def test_non_finite_or_overflowing_values_are_refused_with_nothing_folded(bad):
    delta = np.ones(2 * BLOCK + 5, np.float32)
    delta[-1] = bad
    acc = np.zeros(delta.size, np.float32)
    with pytest.raises(NonFiniteUpdate):
        scan(delta, Fold(acc, 1.0, math.inf))
    np.testing.assert_array_equal(acc, 0)
