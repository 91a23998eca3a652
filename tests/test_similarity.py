"""SimFedSwap's similarity measures on weights: each one against a hand-computed case and against a
per-pair formula written out here (the module computes all pairs at once), and their invariances."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import ortho_group

from flcore.similarity import (
    METRICS,
    deconfounded_cka,
    linear_cka,
    linear_hsic,
    mean_canonical_correlation,
    osad,
    rbf_cka,
    similarity_matrix,
    weight_layers,
)

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def centring(n: int) -> np.ndarray:
    return np.eye(n) - np.ones((n, n)) / n


def hsic_pair(k: np.ndarray, l: np.ndarray) -> float:  # noqa: E741
    h = centring(len(k))
    return float(np.trace(k @ h @ l @ h)) / (len(k) - 1) ** 2


def cka_pair(k: np.ndarray, l: np.ndarray) -> float:  # noqa: E741
    return hsic_pair(k, l) / np.sqrt(hsic_pair(k, k) * hsic_pair(l, l))


def rbf_gram(x: np.ndarray) -> np.ndarray:
    n = len(x)
    distances = np.array([[np.linalg.norm(x[i] - x[j]) for j in range(n)] for i in range(n)])
    sigma = 0.5 * np.median([distances[i, j] for i in range(n) for j in range(n) if i != j])
    return np.exp(-(distances**2) / (2 * sigma**2))


def svcca_pair(x: np.ndarray, y: np.ndarray) -> float:
    """Textbook CCA, Σxx^-1/2 Σxy Σyy^-1/2, on each side's top singular directions (99 % variance)."""

    def reduced(a: np.ndarray) -> np.ndarray:
        u, s, _ = np.linalg.svd(a - a.mean(axis=0), full_matrices=False)
        k = int(np.searchsorted(np.cumsum(s**2) / np.sum(s**2), 0.99 - 1e-12) + 1)
        return u[:, :k] * s[:k]

    def inverse_sqrt(c: np.ndarray) -> np.ndarray:
        values, vectors = np.linalg.eigh(c)
        return vectors @ np.diag(values**-0.5) @ vectors.T

    a, b = reduced(x), reduced(y)
    rho = np.linalg.svd(inverse_sqrt(a.T @ a) @ a.T @ b @ inverse_sqrt(b.T @ b), compute_uv=False)
    return float(np.mean(rho[: min(a.shape[1], b.shape[1])]))


def dcka_pairs(stack: np.ndarray) -> np.ndarray:
    """dK = HKH − α̂·HK⁰H, α̂ by least squares, K⁰ the Gram of the mean of the unit-norm layers."""
    n = stack.shape[1]
    h = centring(n)
    shared = np.mean([x / np.linalg.norm(x) for x in stack], axis=0)
    k0 = h @ shared @ shared.T @ h
    residuals = []
    for x in stack:
        k = h @ x @ x.T @ h
        alpha = np.sum(k * k0) / np.sum(k0 * k0)
        residuals.append(k - alpha * k0)
    return np.array([[np.sum(d * e) / np.linalg.norm(d) / np.linalg.norm(e) for e in residuals] for d in residuals])


def per_pair(stack: np.ndarray, metric: str) -> np.ndarray:
    if metric == "dcka":
        return dcka_pairs(stack)
    pair = {
        "osad": lambda x, y: -np.abs(x - y).sum(),
        "cca": svcca_pair,
        "hsic": lambda x, y: hsic_pair(x @ x.T, y @ y.T),
        "cka": lambda x, y: cka_pair(x @ x.T, y @ y.T),
        "rbf-cka": lambda x, y: cka_pair(rbf_gram(x), rbf_gram(y)),
    }[metric]
    return np.array([[pair(x, y) for y in stack] for x in stack])


LAYERS = st.tuples(
    st.integers(0, 2**32 - 1), st.integers(2, 5), st.integers(3, 9), st.integers(1, 14)
)  # seed, agents, out (samples), fan-in: narrow and wide layers, CCA's direct and complement paths


def random_stack(seed: int, agents: int, out: int, fan_in: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((out, fan_in))
    return np.stack([base + rng.uniform(0.2, 2.0) * rng.standard_normal((out, fan_in)) for _ in range(agents)])


def test_one_feature_three_units_by_hand():
    x = np.array([[1.0], [0.0], [-1.0]])  # already centred; x·y = 1, ‖x‖² = ‖y‖² = 2, corr = 0.5
    y = np.array([[1.0], [-1.0], [0.0]])
    stack = np.stack([x, y])
    assert osad(stack)[0, 1] == pytest.approx(-2.0)  # |0| + |1| + |−1|
    assert mean_canonical_correlation(stack)[0, 1] == pytest.approx(0.5)  # |corr|
    assert linear_hsic(stack)[0, 1] == pytest.approx(1 / 4)  # (xᵀy)² / (n − 1)²
    assert linear_cka(stack)[0, 1] == pytest.approx(0.25)  # corr²


def test_cca_of_a_wide_layer_without_a_dominant_direction_is_trivially_one():
    # 3 units, 2 fan-in with equal variance: both directions are kept, and two 2-dimensional subspaces of
    # the 2-dimensional centred space coincide. The documented weakness of CCA on weights, by hand.
    x = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    y = np.array([[0.0, 1.0], [-1.0, -1.0], [1.0, 0.0]])  # x's rows shifted: a different model
    assert mean_canonical_correlation(np.stack([x, y]))[0, 1] == pytest.approx(1.0)
    assert linear_cka(np.stack([x, y]))[0, 1] < 1.0


@PROPERTY
@given(LAYERS, st.sampled_from(sorted(METRICS)))
def test_every_measure_matches_its_per_pair_formula(layer, metric):
    stack = random_stack(*layer)
    stack = stack.astype(np.float32)  # as weight_layers hands them over
    fast = METRICS[metric](stack)
    np.testing.assert_allclose(fast, per_pair(stack.astype(np.float64), metric), atol=1e-8, rtol=1e-7)
    np.testing.assert_array_equal(fast, fast.T)


def stack_and_rotation(layer: tuple, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random stack of agents' layers and an orthogonal matrix of its fan-in's size."""
    stack = random_stack(*layer)
    fan_in = stack.shape[2]
    return stack, ortho_group.rvs(fan_in, random_state=seed) if fan_in > 1 else np.array([[-1.0]])


@PROPERTY
@given(LAYERS, st.integers(0, 2**31 - 1), st.floats(0.01, 100.0))
def test_cka_cca_and_rbf_cka_ignore_each_agents_own_rotation_and_scaling(layer, seed, scale):
    stack, rotation = stack_and_rotation(layer, seed)
    moved = stack.copy()
    moved[0] = scale * stack[0] @ rotation  # agent 0 alone
    for metric in (linear_cka, rbf_cka, mean_canonical_correlation):
        np.testing.assert_allclose(metric(moved), metric(stack), atol=1e-7)


@PROPERTY
@given(LAYERS, st.integers(0, 2**31 - 1), st.floats(0.01, 100.0))
def test_dcka_ignores_a_common_rotation_and_each_agents_scaling(layer, seed, scale):
    stack, rotation = stack_and_rotation(layer, seed)
    moved = stack @ rotation  # every agent alike: the shared start is rotated too
    moved[0] *= scale
    np.testing.assert_allclose(deconfounded_cka(moved), deconfounded_cka(stack), atol=1e-7)


def test_hsic_ignores_rotation_but_scales_with_the_square_of_each_side():
    stack = random_stack(1, 3, 6, 4)
    moved = stack.copy()
    moved[0] = 3.0 * stack[0] @ ortho_group.rvs(4, random_state=2)
    factor = np.array([9.0, 1.0, 1.0])
    np.testing.assert_allclose(linear_hsic(moved), linear_hsic(stack) * np.outer(factor, factor), rtol=1e-9)
    s = linear_hsic(stack)  # not maximal on the diagonal; bounded by Cauchy–Schwarz
    assert np.all(np.abs(s) <= np.sqrt(np.outer(np.diag(s), np.diag(s))) + 1e-12)


def test_osad_is_zero_only_for_identical_layers_and_negative_otherwise():
    stack = random_stack(3, 3, 5, 4)
    stack[2] = stack[0]
    s = osad(stack)
    assert s[0, 2] == 0 and np.all(np.diag(s) == 0)
    assert s[0, 1] < 0 and s[1, 2] < 0
    assert osad(stack * 2)[0, 1] == pytest.approx(2 * s[0, 1])  # not scale-invariant: it sums distances


@pytest.mark.parametrize("metric", ["osad", "cca", "cka", "rbf-cka", "dcka"])
def test_an_identical_model_is_the_most_similar(metric):
    layers = {
        "conv": random_stack(4, 4, 8, 18).astype(np.float32),  # wide (CCA's complement path)
        "fc": random_stack(5, 4, 10, 3).astype(np.float32),  # narrow
    }
    for x in layers.values():
        x[3] = x[1]
    s = similarity_matrix(layers, metric)
    assert s[1, 3] == pytest.approx(s.max(), abs=1e-9)
    assert np.argmax(np.where(np.eye(4, dtype=bool), -np.inf, s)[1]) == 3
    if metric != "osad":
        np.testing.assert_allclose(np.diag(s), 1.0, atol=1e-9)
        assert s[0, 1] < 1 - 1e-6


def test_dcka_scores_zero_when_nothing_is_left_after_the_shared_model():
    stack = np.stack([random_stack(6, 1, 5, 4)[0]] * 3)
    np.testing.assert_allclose(deconfounded_cka(stack), 0.0, atol=1e-9)


def test_osad_is_minus_the_l1_distance_and_layers_are_averaged_unweighted():
    a = {"w": np.array([[1.0, 2.0]]), "b": np.array([5.0]), "v": np.array([[0.0], [0.0]])}
    b = {"w": np.array([[0.0, 0.0]]), "b": np.array([-5.0]), "v": np.array([[1.0], [1.0]])}
    layers = weight_layers([a, b])
    assert sorted(layers) == ["v", "w"]  # 1-D tensors (biases, BatchNorm) are left out
    np.testing.assert_allclose(osad(layers["w"]), [[0, -3], [-3, 0]])
    np.testing.assert_allclose(similarity_matrix(layers, "osad")[0, 1], (-3 + -2) / 2)
    names = "osad, cca, hsic, cka, rbf-cka, dcka"
    with pytest.raises(ValueError, match=f"strategy.similarity 'cosine' must be one of {names}"):
        similarity_matrix(layers, "cosine")
