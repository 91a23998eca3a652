"""How similar agents' models are, layer by layer, for every pair at once (SimFedSwap, seed 004).

The thesis (Bozorgzad 2024, §4-4…4-8) compares corresponding layers of two networks and takes the
plain mean over layers. Its candidate measures, all here: OSAD (−Σ|X − Y|), CCA, HSIC, linear and RBF
CKA (Kornblith et al. 2019, "Similarity of Neural Network Representations Revisited",
https://arxiv.org/abs/1905.00414) and deconfounded CKA (Cui et al. 2022, "Deconfounded Representation
Similarity for Comparison of Neural Networks", https://arxiv.org/abs/2202.00095). It does not say
whether weights or activations are compared, how conv tensors are reshaped, or whether biases count.
Our choices, since the server has no data to compute activations on:

- **weights**, and only tensors with 2 or more dimensions (conv and linear weights): biases and
  BatchNorm vectors are left out (a 1-row "layer" has no structure for CKA to compare);
- a tensor of shape (out, in, kh, kw) becomes the matrix X (out × in·kh·kw): each output unit is a
  "sample" described by its incoming weights. CKA, dCKA and CCA are then invariant to an orthogonal
  transform of the fan-in space (X → XU) and to isotropic scaling (X → αX), the two properties the
  thesis asks for (dCKA: when every agent's layer is transformed alike, see ``deconfounded_cka``);
  HSIC only to the first, OSAD to neither;
- RBF CKA: σ = ``RBF_SIGMA_FRACTION`` × the median distance between the rows of X (the thesis says
  "a fraction of the median" without the value; 0.5 is ours);
- CCA and dCKA: see their functions (the thesis's definitions assume activations; on weights each
  needs a choice, documented there).

Everything is vectorised over agents: the kernel measures centre each agent's Gram matrix (out × out
per layer) once and get all pairs from one matrix product; OSAD uses scipy's C ``pdist`` (cityblock,
each pair once); CCA batches the pairs' small SVDs. Inputs are (agents × out × fan-in) arrays per layer,
computed in float64; the output is an (agents × agents) matrix, larger = more similar.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

RBF_SIGMA_FRACTION = 0.5
CCA_KEPT_VARIANCE = 0.99  # SVCCA's cut (Raghu et al. 2017): the directions explaining 99 % of the variance
CCA_PAIRS_PER_BATCH = 4096  # bounds the pairs' stacked (w × w) matrices to ~130 MB at w = 64
RESIDUAL_TOLERANCE = 1e-9  # dCKA: a residual this small against its Gram is rounding, not a departure
Layers = Mapping[str, np.ndarray]  # layer name → (agents, out, fan_in) float array


def weight_layers(models: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stack the agents' weight tensors (2+ dimensions) as (agents, out, fan_in) float32 arrays."""
    names = [name for name, value in models[0].items() if np.ndim(value) >= 2]
    return {
        name: np.stack([np.asarray(m[name], np.float32).reshape(np.shape(m[name])[0], -1) for m in models])
        for name in names
    }


def osad(x: np.ndarray) -> np.ndarray:
    """Opposite sum of absolute differences between every pair of agents' layer (N × N)."""
    from scipy.spatial.distance import pdist, squareform  # SciPy on first use (flcore.blas says why)

    return -squareform(pdist(x.reshape(len(x), -1).astype(np.float64), metric="cityblock"))


def _linear_grams(x: np.ndarray) -> np.ndarray:
    """(N, n, p) layers → (N, n, n) Gram matrices K = X Xᵀ, in float64."""
    x = x.astype(np.float64)
    return np.matmul(x, x.transpose(0, 2, 1))  # batched BLAS; einsum here is several times slower


def _centred(grams: np.ndarray) -> np.ndarray:
    """(N, n, n) Gram matrices → (N, n·n) rows of H K H (H = I − 11ᵀ/n centres the n samples)."""
    centred = grams - grams.mean(axis=1, keepdims=True)
    centred = centred - centred.mean(axis=2, keepdims=True)
    return centred.reshape(len(grams), -1)


def _unit_rows(flat: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length; an all-zero row stays zero (its similarity to everything is 0)."""
    norms = np.linalg.norm(flat, axis=1, keepdims=True)
    return flat / np.where(norms > 0, norms, 1.0)


def _alignment(centred: np.ndarray) -> np.ndarray:
    """CKA from centred Grams: ⟨HKH, HLH⟩ / (‖HKH‖·‖HLH‖) for every pair, one matrix product."""
    g = _unit_rows(centred)
    return g @ g.T


def linear_cka(x: np.ndarray) -> np.ndarray:
    """Linear CKA between every pair of agents' layer: ⟨HKH, HLH⟩ / (‖HKH‖·‖HLH‖) with K = X Xᵀ."""
    return _alignment(_centred(_linear_grams(x)))


def linear_hsic(x: np.ndarray) -> np.ndarray:
    """Linear HSIC, unnormalised: tr(K H L H) / (n − 1)² = ‖cov(Xᵀ, Yᵀ)‖_F² (seed 004, §4-4…4-8).

    Not scale-invariant: HSIC(αX, βY) = α²β²·HSIC(X, Y), so a layer with larger weights looks "more
    similar" to everyone, and MSS pairs the agents with the smallest weights first. Identical layers
    are not the maximum of a row either; Cauchy–Schwarz bounds HSIC(X, Y) by √(HSIC(X, X)·HSIC(Y, Y)).
    CKA is this measure normalised. Kept because the thesis lists it.
    """
    centred = _centred(_linear_grams(x))
    samples = x.shape[1]
    return centred @ centred.T / max(samples - 1, 1) ** 2


def rbf_cka(x: np.ndarray, sigma_fraction: float = RBF_SIGMA_FRACTION) -> np.ndarray:
    """RBF CKA: K_ij = exp(−‖xᵢ − xⱼ‖² / 2σ²), σ a fraction of the median distance between rows."""
    grams = _linear_grams(x)
    squared = np.diagonal(grams, axis1=1, axis2=2)
    distances = np.maximum(squared[:, :, None] + squared[:, None, :] - 2 * grams, 0.0)
    n = x.shape[1]
    off_diagonal = distances[:, ~np.eye(n, dtype=bool)]
    median = np.median(np.sqrt(off_diagonal), axis=1) if n > 1 else np.ones(len(x))
    sigma = sigma_fraction * np.where(median > 0, median, 1.0)
    return _alignment(_centred(np.exp(-distances / (2 * sigma[:, None, None] ** 2))))


def deconfounded_cka(x: np.ndarray) -> np.ndarray:
    """Deconfounded linear CKA (Cui et al. 2022): CKA(dK, dL) with dK = K − α̂K⁰.

    α̂ is the least-squares fit of vec(K) on vec(K⁰) (seed 004), fitted to the centred matrices HKH and
    HK⁰H, the part CKA compares (H is linear, so only the fit differs from fitting raw Grams): dK is
    then HKH with its component along HK⁰H removed. In the paper K⁰ is the similarity of the inputs,
    the structure every representation inherits. On weights there are no inputs; **our choice** of
    confound is what every agent inherits from the common start: K⁰ = X̄ X̄ᵀ for X̄ the mean over the
    compared agents of each one's layer scaled to unit Frobenius norm (the scaling keeps dCKA invariant
    to one agent's isotropic scaling). dCKA thus asks how alike two agents' departures from the shared
    model are. Invariant to an orthogonal transform of the fan-in space applied to every agent alike;
    one agent rotated alone changes the confound (it no longer shares the start), so not to that.
    When all agents are identical nothing is left after the confound and every pair scores 0.
    """
    x = x.astype(np.float64)
    norms = np.linalg.norm(x.reshape(len(x), -1), axis=1)
    shared = np.mean(x / np.where(norms > 0, norms, 1.0)[:, None, None], axis=0)
    confound = _unit_rows(_centred(_linear_grams(shared[None])))[0]
    centred = _centred(_linear_grams(x))
    residual = centred - np.outer(centred @ confound, confound)
    rounding = np.linalg.norm(residual, axis=1) <= RESIDUAL_TOLERANCE * np.linalg.norm(centred, axis=1)
    return _alignment(np.where(rounding[:, None], 0.0, residual))


def _cca_bases(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per agent, the eigenvectors of the centred Gram (N, n, n), largest first, and how many explain
    ``CCA_KEPT_VARIANCE`` of the variance (N,): its SVCCA subspace (the left singular vectors)."""
    samples = x.shape[1]
    variances, vectors = np.linalg.eigh(_centred(_linear_grams(x)).reshape(len(x), samples, samples))
    variances, vectors = np.maximum(variances[:, ::-1], 0.0), vectors[:, :, ::-1]
    total = variances.sum(axis=1, keepdims=True)
    explained = np.cumsum(variances, axis=1) / np.where(total > 0, total, 1.0)
    kept = np.where(total[:, 0] > 0, 1 + np.sum(explained < CCA_KEPT_VARIANCE - 1e-12, axis=1), 0)
    return vectors, kept


def mean_canonical_correlation(x: np.ndarray) -> np.ndarray:
    """SVCCA's mean canonical correlation ρ̄ = (1/k) Σᵢ ρᵢ between every pair of agents' layer.

    SkyFed's target is the mean canonical correlation, so this is ρ̄ (Kornblith et al.'s ρ̄_CCA), not
    the thesis's R²_CCA = Σρᵢ²/p₁ (both are 1 for identical subspaces and fall as they part; R²_CCA
    counts weak correlations less), and ρ̄ is the figure SVCCA reports. Samples are the n output units
    (as for CKA); the features, the fan-in, are compared through the subspace of ℝⁿ they span. Plain
    CCA on weights is trivial: whenever fan-in ≥ out − 1 the centred columns span all of the
    (n − 1)-dimensional centred space and every ρᵢ = 1. So, as SVCCA does (Raghu et al. 2017,
    "SVCCA: Singular Vector Canonical Correlation Analysis for Deep Learning Dynamics and
    Interpretability", https://arxiv.org/abs/1706.05806), each agent keeps only the top k singular
    directions explaining 99 % of its variance, and the ρᵢ are the singular values of Q_Aᵀ Q_B (Q:
    those left singular vectors; the ρᵢ are the cosines of the principal angles between the two
    subspaces), averaged over min(k_A, k_B).
    It stays weak on wide layers: two subspaces with k_A + k_B > n share k_A + k_B − n directions,
    each a ρ of 1 (few samples, many features: the regime where SVCCA warns CCA overfits); prefer CKA.

    Speed: Σρ(A, B) = Σρ(A⊥, B⊥) + k_A + k_B − n (the principal angles strictly between 0 and 90°
    are the same for two subspaces and for their orthogonal complements), so when the kept subspaces
    are more than half of ℝⁿ the SVDs run on the smaller complements. Orthogonal transforms of the
    fan-in and scaling leave the centred Gram's eigenvectors, hence ρ̄, unchanged. A layer with no
    variance (all output units alike) scores 0 against everything.
    """
    vectors, kept = _cca_bases(x)
    agents, n = len(x), x.shape[1]
    complement = int(kept.max(initial=0)) > int((n - kept).max(initial=0))
    if complement:
        columns, width = np.arange(n)[None, :] >= kept[:, None], int((n - kept).max())
        bases = (vectors * columns[:, None, :])[:, :, n - width :]  # width ≥ 1: a centred rank is < n
    else:
        columns, width = np.arange(n)[None, :] < kept[:, None], int(kept.max(initial=0))
        bases = (vectors * columns[:, None, :])[:, :, :width]
    first, second = np.triu_indices(agents, k=1)
    sums = np.empty(len(first))
    for start in range(0, len(first), CCA_PAIRS_PER_BATCH):
        a, b = first[start : start + CCA_PAIRS_PER_BATCH], second[start : start + CCA_PAIRS_PER_BATCH]
        overlaps = np.matmul(bases[a].transpose(0, 2, 1), bases[b])
        sums[start : start + len(a)] = np.linalg.svd(overlaps, compute_uv=False).sum(axis=1) if width else 0.0
    if complement:
        sums += kept[first] + kept[second] - n
    smaller = np.minimum(kept[first], kept[second])
    similarity = np.diag((kept > 0).astype(np.float64))
    similarity[first, second] = np.where(smaller > 0, sums / np.maximum(smaller, 1), 0.0)
    similarity[second, first] = similarity[first, second]
    return similarity


METRICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "osad": osad,
    "cca": mean_canonical_correlation,
    "hsic": linear_hsic,
    "cka": linear_cka,
    "rbf-cka": rbf_cka,
    "dcka": deconfounded_cka,
}


def similarity_matrix(layers: Layers, metric: str) -> np.ndarray:
    """The unweighted mean over layers of ``metric`` for every pair of agents (N × N)."""
    if metric not in METRICS:
        raise ValueError(f"strategy.similarity {metric!r} must be one of {', '.join(METRICS)}")
    if not layers:
        raise ValueError("the model has no weight tensor with 2 or more dimensions to compare")
    return np.mean([METRICS[metric](x) for x in layers.values()], axis=0)
