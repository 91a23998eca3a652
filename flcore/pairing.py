"""Who swaps models with whom, and when (FedSwap, Chiu et al. 2020; SimFedSwap, seed 004).

Schedule (FedSwap, Alg. 4-1 of the thesis): in round t, ``swap`` when t mod h1 = 0 and t mod h1·h2 ≠ 0,
``average`` when t mod h1·h2 = 0, ``local`` training otherwise — so a cycle of h1·h2 rounds holds
h2 − 1 swaps and one weighted average (the thesis checks 81 swap rounds in 610 with h1 = 5, h2 = 3).

Pairing, over a similarity matrix (larger = more similar; ``flcore.similarity``):
- ``random`` (FedSwap): agents shuffled and paired in order;
- ``gs`` (Greedy Swapping, Alg. 4-2): a random remaining agent takes its least similar remaining one;
- ``mss`` (Minimum Similarity Swapping, Alg. 4-3, the thesis's default): repeatedly the least similar
  remaining pair overall.
``swap_fraction`` (the thesis's SP) makes ⌊n/2 · SP⌋ pairs. The thesis leaves the rest open; our rule:
an agent left unpaired (odd n, or SP < 1) keeps its own model, and agents not selected in a round are
not paired at all. All functions are pure; ``rng`` makes random choices reproducible.
"""

from __future__ import annotations

import numpy as np

PAIRINGS = ("random", "gs", "mss")


def fedswap_action(round_number: int, h1: int, h2: int) -> str:
    """``"swap"``, ``"average"`` or ``"local"`` for round ``round_number`` (1-based)."""
    if round_number % (h1 * h2) == 0:
        return "average"
    return "swap" if round_number % h1 == 0 else "local"


def pair_count(n: int, swap_fraction: float) -> int:
    return int(n // 2 * swap_fraction)


def pair_random(n: int, swap_fraction: float, rng: np.random.Generator) -> list[tuple[int, int]]:
    order = rng.permutation(n)
    return [(int(order[2 * i]), int(order[2 * i + 1])) for i in range(pair_count(n, swap_fraction))]


def pair_greedy(similarity: np.ndarray, swap_fraction: float, rng: np.random.Generator) -> list[tuple[int, int]]:
    """GS: a random remaining anchor is paired with its least similar remaining agent."""
    remaining = list(range(len(similarity)))
    pairs = []
    for _ in range(pair_count(len(similarity), swap_fraction)):
        anchor = remaining.pop(int(rng.integers(len(remaining))))
        partner = remaining[int(np.argmin(similarity[anchor, remaining]))]
        remaining.remove(partner)
        pairs.append((anchor, partner))
    return pairs


def pair_minimum_similarity(similarity: np.ndarray, swap_fraction: float) -> list[tuple[int, int]]:
    """MSS: the least similar remaining pair, again and again (ties: the lowest indices)."""
    n = len(similarity)
    masked = np.where(np.triu(np.ones((n, n), dtype=bool), k=1), similarity.astype(np.float64), np.inf)
    pairs = []
    for _ in range(pair_count(n, swap_fraction)):
        row, col = np.unravel_index(int(np.argmin(masked)), masked.shape)
        masked[[row, col], :] = np.inf
        masked[:, [row, col]] = np.inf
        pairs.append((int(row), int(col)))
    return pairs


def pair_agents(
    pairing: str, similarity: np.ndarray | None, n: int, swap_fraction: float, rng: np.random.Generator
) -> list[tuple[int, int]]:
    if pairing == "random":
        return pair_random(n, swap_fraction, rng)
    if similarity is None:
        raise ValueError(f"pairing {pairing!r} needs a similarity matrix")
    if pairing == "gs":
        return pair_greedy(similarity, swap_fraction, rng)
    if pairing == "mss":
        return pair_minimum_similarity(similarity, swap_fraction)
    raise ValueError(f"strategy.pairing {pairing!r} must be one of {', '.join(PAIRINGS)}")
