"""The robust strategies' fast kernels against the plain NumPy they replace: a sorting network per column block
(median, trimmed mean), a shifted float32 Gram matrix (Krum, the default's agreement, the personalized
strategies' distances) and weighted sums in BLAS (Krum's mean, centered clipping). The median and trimmed
mean must be bit-identical; the rest within float32 rounding of a float64 reference, with the same choices."""

from __future__ import annotations

import functools
import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flcore import blas
from flcore.bounds import lower_median
from flcore.order_statistics import NETWORK_MAX, column_median, column_trimmed_mean, order_statistics, sorting_network
from flcore.strategies import base, build_strategy
from flcore.strategies import mixing as mixing_module
from flcore.strategies.base import Contribution
from flcore.strategies.krum import gram_matrix, krum_scores, squared_distances
from flcore.strategies.trimmed_mean import trim_count


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of a few dozen columns, so every test crosses many block boundaries and a short last block."""
    monkeypatch.setattr(base, "BLOCK_BYTES", 4 * 7 * 37)
    monkeypatch.setattr(base, "BLOCK_MIN_COLUMNS", 37)


def round_of(seed: int, n: int, size: int, *, ties: bool = False, clipped: bool = True) -> list[Contribution]:
    rng = np.random.default_rng(seed)
    deltas = rng.standard_normal((n, size)).astype(np.float32)
    if ties:
        deltas[:, : size // 2] = np.round(deltas[:, : size // 2])
    scales = rng.uniform(0.2, 1.0, n) if clipped else np.ones(n)
    samples = rng.integers(10, 500, n)
    return [
        Contribution(f"agent-{i:02d}", d, float(w), float(s), float(np.linalg.norm(d)))
        for i, (d, w, s) in enumerate(zip(deltas, samples, scales, strict=True))
    ]


def clipped_stack(contributions: list[Contribution]) -> np.ndarray:
    return np.stack([c.delta * np.float32(c.scale) for c in contributions])


@pytest.mark.parametrize("n", range(1, 13))
def test_the_sorting_network_sorts_every_zero_one_input(n: int) -> None:
    """The 0-1 principle: a comparator network that sorts all 2ⁿ zero-one inputs sorts every input."""
    inputs = np.array(list(itertools.product((0, 1), repeat=n)), np.float32).T.copy()
    inputs.flags.writeable = False  # the network only reads the updates
    np.testing.assert_array_equal(np.stack(order_statistics(inputs, tuple(range(n)))), np.sort(inputs, axis=0))
    for wanted in {(0,), ((n - 1) // 2, n // 2), (n - 1,), tuple(range(n // 3, n - n // 3))}:
        np.testing.assert_array_equal(np.stack(order_statistics(inputs, wanted)), np.sort(inputs, axis=0)[list(wanted)])
    assert all(low < high < n for low, high in sorting_network(n))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40) | st.sampled_from([NETWORK_MAX, NETWORK_MAX + 1]), width=st.integers(2, 200),
       seed=st.integers(0, 2**32 - 1), ties=st.booleans())  # fmt: skip
def test_column_median_and_trimmed_mean_are_numpys_bit_for_bit(n: int, width: int, seed: int, ties: bool) -> None:
    """(NumPy sums a one-column block pairwise, so its trimmed mean there may differ in the last bit.)"""
    block = np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)
    if ties:
        block = np.round(block)
    out = np.empty(width, np.float32)
    column_median(list(block), out)
    np.testing.assert_array_equal(out, np.median(block, axis=0))
    trim = trim_count(n, 0.2)
    column_trimmed_mean(list(block), trim, out)
    np.testing.assert_array_equal(out, np.sort(block, axis=0)[trim : n - trim].mean(axis=0, dtype=np.float32))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), size=st.integers(1, 400), seed=st.integers(0, 2**32 - 1), ties=st.booleans())
def test_median_and_trimmed_mean_strategies_equal_the_stacked_numpy_result(n, size, seed, ties) -> None:  # noqa: ANN001
    contributions = round_of(seed, n, size, ties=ties)
    start = np.random.default_rng(seed + 1).standard_normal(size).astype(np.float32)
    stacked = clipped_stack(contributions)
    median = build_strategy({"name": "median"}).aggregate(start, contributions).global_vector
    np.testing.assert_array_equal(median, start + np.median(stacked, axis=0))
    kept = np.sort(stacked, axis=0)[trim_count(n, 0.2) : n - trim_count(n, 0.2)]
    total = kept[0].copy()
    for row in kept[1:]:  # in ascending order, as NumPy's mean over the rows of a block wider than one column
        total += row
    trimmed = build_strategy({"name": "trimmed-mean"}).aggregate(start, contributions).global_vector
    np.testing.assert_array_equal(trimmed, start + total / np.float32(len(kept)))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 25), size=st.integers(1, 500), seed=st.integers(0, 2**32 - 1), offset=st.sampled_from([0, 50]))
def test_gram_matrix_matches_float64_even_for_updates_far_from_zero(n, size, seed, offset) -> None:  # noqa: ANN001
    """Updates that share a large common part (offset) and differ by little: the shifted float32 products keep
    their distances as accurate as float64 ones, where plain float32 would lose them to cancellation."""
    contributions = round_of(seed, n, size)
    common = np.float32(offset) * np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    contributions = [Contribution(c.agent, c.delta + common, c.samples, 1.0, c.norm) for c in contributions]
    exact = clipped_stack(contributions).astype(np.float64)
    gram = gram_matrix(contributions)
    np.testing.assert_allclose(gram, exact @ exact.T, rtol=1e-5, atol=1e-4 * (1 + offset**2))
    differences = exact[:, None, :] - exact[None, :, :]
    np.testing.assert_allclose(squared_distances(gram), (differences**2).sum(axis=2), rtol=1e-4, atol=1e-3)
    center = exact[0].astype(np.float32)
    means = np.empty(size, np.float32)
    np.testing.assert_allclose(gram_matrix(contributions, center=center, means=means),
                               (exact - center) @ (exact - center).T, rtol=1e-4, atol=1e-3)  # fmt: skip
    np.testing.assert_allclose(means, exact.mean(axis=0), rtol=1e-5, atol=1e-5 * (1 + offset))
    gram_matrix(contributions, means=means)
    np.testing.assert_allclose(means, exact.mean(axis=0), rtol=1e-5, atol=1e-5 * (1 + offset))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(3, 20), size=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_krum_keeps_the_float64_choice_and_averages_within_float32_rounding(n, size, seed) -> None:  # noqa: ANN001
    contributions = round_of(seed, n, size)
    strategy = build_strategy({"name": "krum", "f": 1})
    start = np.zeros(size, np.float32)
    result = strategy.aggregate(start, contributions)
    exact = clipped_stack(contributions).astype(np.float64)
    distances = ((exact[:, None, :] - exact[None, :, :]) ** 2).sum(axis=2)
    f = result.detail["f_used"]
    chosen = np.sort(np.argsort(krum_scores(distances, f), kind="stable")[: strategy.kept(n)])
    assert result.detail["selected"] == [contributions[i].agent for i in chosen]
    np.testing.assert_allclose(result.global_vector, exact[chosen].mean(axis=0), rtol=1e-5, atol=1e-6)


def centered_clip_reference(contributions: list[Contribution], reference: np.ndarray, tau: float) -> np.ndarray:
    """Karimireddy et al.'s one clipping iteration in float64, written out: v + Σ wᵢ·min(1, τ/‖xᵢ − v‖)(xᵢ − v)."""
    x = clipped_stack(contributions).astype(np.float64)
    weights = np.array([c.samples for c in contributions]) / sum(c.samples for c in contributions)
    distances = np.linalg.norm(x - reference, axis=1)
    tau = tau * lower_median(distances)
    clip = np.minimum(1.0, np.divide(tau, distances, out=np.ones_like(distances), where=distances > 0))
    return reference + ((weights * clip)[:, None] * (x - reference)).sum(axis=0)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 20), size=st.integers(1, 300), seed=st.integers(0, 2**32 - 1),
       tau=st.sampled_from([0.5, 1.0, 3.0]))  # fmt: skip
def test_centered_clipping_equals_its_float64_formula(n, size, seed, tau) -> None:  # noqa: ANN001
    contributions = round_of(seed, n, size)
    strategy = build_strategy({"name": "centered-clip", "tau_multiple": tau})
    reference = 0.1 * np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    strategy.restore({"reference": reference})
    start = np.zeros(size, np.float32)
    out = strategy.aggregate(start, contributions)
    bounded = reference * np.float32(out.detail.get("reference_shrunk", 1.0))
    expected = centered_clip_reference(contributions, bounded.astype(np.float64), tau)
    np.testing.assert_allclose(out.global_vector, expected, rtol=1e-4, atol=1e-5)
    around_median = strategy.aggregate_around(start, contributions, "median").global_vector
    median = np.median(clipped_stack(contributions), axis=0).astype(np.float64)
    np.testing.assert_allclose(around_median, centered_clip_reference(contributions, median, tau), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_an_update_accepted_first_cannot_skew_the_distances_between_the_others(seed: int) -> None:
    """Nine honest updates 1 % apart and a rogue at -2x sent first: Krum keeps float64's choice (a shift by the
    first update made the float32 rounding the rogue's distance, and changed which honest updates were kept)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(40_000).astype(np.float32)
    rows = [-2 * base] + [base + np.float32(0.01) * rng.standard_normal(base.size).astype(np.float32) for _ in range(9)]
    contributions = [Contribution(f"a{i}", r, 1.0, 1.0, 0.0) for i, r in enumerate(rows)]
    strategy = build_strategy({"name": "krum", "f": 3})
    result = strategy.aggregate(np.zeros(base.size, np.float32), contributions)
    exact = np.stack(rows).astype(np.float64)
    distances = ((exact[:, None, :] - exact[None, :, :]) ** 2).sum(axis=2)
    chosen = np.sort(np.argsort(krum_scores(distances, result.detail["f_used"]), kind="stable")[: strategy.kept(10)])
    assert result.detail["selected"] == [contributions[i].agent for i in chosen]


@pytest.mark.parametrize("huge", [5e17, 2e19])
def test_values_near_float32s_range_keep_a_finite_gram_matrix(huge: float) -> None:
    """Two colluders at ±huge (finite, accepted with clipping off): at 2e19 the float32 products overflow and the
    block is redone in float64; either way the matrix is finite and right to float32 rounding of its scale."""
    rows = [np.full(1000, huge, np.float32), np.full(1000, -huge, np.float32), np.ones(1000, np.float32)]
    means = np.empty(1000, np.float32)
    gram = gram_matrix([Contribution(f"a{i}", r, 1.0, 1.0, 0.0) for i, r in enumerate(rows)], means=means)
    exact = np.stack(rows).astype(np.float64) @ np.stack(rows).astype(np.float64).T
    assert np.isfinite(gram).all()
    np.testing.assert_allclose(means, 1 / 3, atol=1e-6 * huge)  # within float32 rounding of the values' scale
    np.testing.assert_allclose(gram, exact, rtol=1e-6, atol=1e-6 * np.abs(exact).max())


@pytest.mark.parametrize("threads", [1, 3])
def test_the_parallel_kernels_give_the_same_bits_on_any_number_of_threads(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """The Gram matrix's per-part sums and the mixed models' columns do not depend on how many cores share them:
    a server's choices (Krum's kept updates, DemLearn's clusters) are the same on a drone's 2 cores and on 4."""
    contributions = round_of(7, 9, 1001)
    center = np.random.default_rng(8).standard_normal(1001).astype(np.float32)
    mixing = np.random.default_rng(9).random((5, 9))
    gram = gram_matrix(contributions, center=center)
    mixed = [m.copy() for _, m in mixing_module.mixed_models(contributions, mixing)]
    chunks = [rows.copy() for rows in mixing_module.mixed_chunks(contributions, mixing)]
    monkeypatch.setattr(blas, "_pool", functools.cache(lambda: ThreadPoolExecutor(threads)))
    np.testing.assert_array_equal(gram_matrix(contributions, center=center), gram)
    for (_, got), want in zip(mixing_module.mixed_models(contributions, mixing), mixed, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(mixing_module.mixed_chunks(contributions, mixing), chunks, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_failing_part_of_a_parallel_kernel_raises_after_the_others_end() -> None:
    ended = []

    def work(part: int, parts: int) -> None:
        if part == 1:
            raise ValueError("part 1 failed")
        ended.append(part)

    with pytest.raises(ValueError, match="part 1 failed"):
        blas.in_parallel(work)
    assert sorted(ended) == [p for p in range(blas.PARTS) if p != 1]
