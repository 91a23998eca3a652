"""How similar agents' models are, layer by layer, for every pair at once (SimFedSwap, seed 004).

The thesis (Bozorgzad 2024, §4-4…4-8) compares corresponding layers of two networks and takes the
plain mean over layers, with OSAD (−Σ|X − Y|), linear CKA and RBF CKA (Kornblith et al. 2019,
"Similarity of Neural Network Representations Revisited", https://arxiv.org/abs/1905.00414). It does
not say whether weights or activations are compared, how conv tensors are reshaped, or whether biases
count. Our choices, since the server has no data to compute activations on:

- **weights**, and only tensors with 2 or more dimensions (conv and linear weights): biases and
  BatchNorm vectors are left out (a 1-row "layer" has no structure for CKA to compare);
- a tensor of shape (out, in, kh, kw) becomes the matrix X (out × in·kh·kw): each output unit is a
  "sample" described by its incoming weights. CKA is then invariant to any orthogonal transform of the
  fan-in space (X → XU) and to isotropic scaling (X → αX), the two properties the thesis asks for;
- RBF CKA: σ = ``RBF_SIGMA_FRACTION`` × the median distance between the rows of X (the thesis says
  "a fraction of the median" without the value; 0.5 is ours).

Everything is vectorised over agents: for CKA each agent's centred Gram matrix (out × out per layer) is
flattened and normalised once, and all pairs come from one matrix product; OSAD uses scipy's C
``pdist`` (cityblock, each pair once). Inputs are (agents × out × fan-in) arrays per layer; the output is an
(agents × agents) matrix, larger = more similar.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from scipy.spatial.distance import pdist, squareform

RBF_SIGMA_FRACTION = 0.5
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
    return -squareform(pdist(x.reshape(len(x), -1).astype(np.float64), metric="cityblock"))


def _normalised_centred_grams(grams: np.ndarray) -> np.ndarray:
    """(N, n, n) Gram matrices → (N, n·n) rows of H K H / ‖H K H‖ (H centres the n samples)."""
    centred = grams - grams.mean(axis=1, keepdims=True)
    centred = centred - centred.mean(axis=2, keepdims=True)
    flat = centred.reshape(len(grams), -1)
    norms = np.linalg.norm(flat, axis=1, keepdims=True)
    return flat / np.where(norms > 0, norms, 1.0)


def linear_cka(x: np.ndarray) -> np.ndarray:
    """Linear CKA between every pair of agents' layer: ⟨HKH, HLH⟩ / (‖HKH‖·‖HLH‖) with K = X Xᵀ."""
    x = x.astype(np.float64)
    grams = np.einsum("aip,ajp->aij", x, x)
    g = _normalised_centred_grams(grams)
    return g @ g.T


def rbf_cka(x: np.ndarray, sigma_fraction: float = RBF_SIGMA_FRACTION) -> np.ndarray:
    """RBF CKA: K_ij = exp(−‖xᵢ − xⱼ‖² / 2σ²), σ a fraction of the median distance between rows."""
    x = x.astype(np.float64)
    squared = np.einsum("aip,aip->ai", x, x)
    distances = np.maximum(squared[:, :, None] + squared[:, None, :] - 2 * np.einsum("aip,ajp->aij", x, x), 0.0)
    n = x.shape[1]
    off_diagonal = distances[:, ~np.eye(n, dtype=bool)]
    median = np.median(np.sqrt(off_diagonal), axis=1) if n > 1 else np.ones(len(x))
    sigma = sigma_fraction * np.where(median > 0, median, 1.0)
    grams = np.exp(-distances / (2 * sigma[:, None, None] ** 2))
    g = _normalised_centred_grams(grams)
    return g @ g.T


METRICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"osad": osad, "cka": linear_cka, "rbf-cka": rbf_cka}


def similarity_matrix(layers: Layers, metric: str) -> np.ndarray:
    """The unweighted mean over layers of ``metric`` for every pair of agents (N × N)."""
    if metric not in METRICS:
        raise ValueError(f"strategy.similarity {metric!r} must be one of {', '.join(METRICS)}")
    if not layers:
        raise ValueError("the model has no weight tensor with 2 or more dimensions to compare")
    return np.mean([METRICS[metric](x) for x in layers.values()], axis=0)
