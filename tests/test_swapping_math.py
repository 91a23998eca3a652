"""SimFedSwap's pure parts against hand-computed cases: the FedSwap schedule, MSS and GS pairs for a
known similarity matrix (the similarity measures: tests/test_similarity.py)."""

import numpy as np
import pytest

from flcore.pairing import (
    fedswap_action,
    pair_agents,
    pair_greedy,
    pair_minimum_similarity,
    pair_random,
)


def test_fedswap_schedule_round_by_round():
    actions = [fedswap_action(t, h1=2, h2=3) for t in range(1, 13)]
    assert actions == ["local", "swap", "local", "swap", "local", "average"] * 2
    swaps = sum(fedswap_action(t, 5, 3) == "swap" for t in range(1, 610))
    assert swaps == 81  # the thesis's check for its Fig 5-17 run


SIMILARITY = np.array(
    [
        [0.0, 0.9, 0.1, 0.5],
        [0.9, 0.0, 0.4, 0.2],
        [0.1, 0.4, 0.0, 0.8],
        [0.5, 0.2, 0.8, 0.0],
    ]
)


def test_mss_takes_the_least_similar_pair_then_the_least_similar_of_the_rest():
    assert pair_minimum_similarity(SIMILARITY, 1.0) == [(0, 2), (1, 3)]
    assert pair_minimum_similarity(SIMILARITY, 0.5) == [(0, 2)]  # SP = 0.5: one pair of the two


def test_gs_pairs_each_random_anchor_with_its_least_similar_remaining_agent():
    class Anchors:  # the "random" anchors, chosen by the test: agent 1 first, then agent 0
        def __init__(self):
            self.picks = iter([1, 0])

        def integers(self, n):  # noqa: ANN001, ANN201
            return next(self.picks)

    assert pair_greedy(SIMILARITY, 1.0, Anchors()) == [(1, 3), (0, 2)]


def test_random_pairing_uses_everyone_once_and_leaves_the_odd_agent_alone():
    pairs = pair_random(7, 1.0, np.random.default_rng(0))
    used = [a for pair in pairs for a in pair]
    assert len(pairs) == 3 and len(set(used)) == 6
    with pytest.raises(ValueError, match="strategy.pairing 'best' must be one of random, gs, mss"):
        pair_agents("best", SIMILARITY, 4, 1.0, np.random.default_rng(0))
