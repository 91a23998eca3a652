"""SimFedSwap's pure parts against hand-computed cases: the FedSwap schedule, MSS and GS pairs for a
known similarity matrix, and CKA's invariances."""

import numpy as np
import pytest
from scipy.stats import ortho_group

from broker_server.pairing import (
    fedswap_action,
    pair_agents,
    pair_greedy,
    pair_minimum_similarity,
    pair_random,
)
from broker_server.similarity import linear_cka, osad, rbf_cka, similarity_matrix, weight_layers


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


def test_cka_of_a_layer_with_itself_is_one_and_ignores_rotations_and_scaling():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 30))
    rotated = 3.7 * x @ ortho_group.rvs(30, random_state=1)  # orthogonal transform and isotropic scaling
    other = rng.standard_normal((12, 2)) @ rng.standard_normal((2, 30))  # rank 2: structurally different
    stacked = np.stack([x, rotated, other])
    for metric in (linear_cka, rbf_cka):
        s = metric(stacked)
        np.testing.assert_allclose(np.diag(s), 1.0, atol=1e-9)
        np.testing.assert_allclose(s[0, 1], 1.0, atol=1e-9)
        assert s[0, 2] < 0.9 and np.allclose(s, s.T)


def test_osad_is_minus_the_l1_distance_and_layers_are_averaged_unweighted():
    a = {"w": np.array([[1.0, 2.0]]), "b": np.array([5.0]), "v": np.array([[0.0], [0.0]])}
    b = {"w": np.array([[0.0, 0.0]]), "b": np.array([-5.0]), "v": np.array([[1.0], [1.0]])}
    layers = weight_layers([a, b])
    assert sorted(layers) == ["v", "w"]  # 1-D tensors (biases, BatchNorm) are left out
    np.testing.assert_allclose(osad(layers["w"]), [[0, -3], [-3, 0]])
    np.testing.assert_allclose(similarity_matrix(layers, "osad")[0, 1], (-3 + -2) / 2)
    with pytest.raises(ValueError, match="strategy.similarity 'cosine' must be one of osad, cka, rbf-cka"):
        similarity_matrix(layers, "cosine")
