"""How far one agent can move a round's aggregate under differential privacy: the L2 sensitivities the
noise is calibrated to (``broker_server.privacy.noise``), with their proofs.

Setting (``broker_server.privacy.policy``): a round aggregates n updates x₁…xₙ, each clipped to ‖xᵢ‖ ≤ S; n is
public (the round task names the selected agents and the metrics the accepted ones). Neighbouring rounds
differ in one agent's contribution replaced by the zero update with the same n (dp-accounting's
``REPLACE_SPECIAL``); its weight (samples or objects) is part of its data. The sensitivity Δ of an
aggregate A is the largest ‖A(D) − A(D')‖ over such neighbours; adding N(0, z²Δ²) to every value of A
makes the round a Gaussian mechanism of noise multiplier z, which is what the accountant charges.
"""

from __future__ import annotations


def mean_sensitivity(updates: int, clip: float) -> float:
    """DP-FedAvg's average with a fixed denominator: Δ = S / n.

    A = Σₖ wₖ·xₖ / n with every weight wₖ ∈ [0, 1] a function of agent k's own data alone (uniform: wₖ = 1;
    with ``privacy.weight_cap`` ŵ, wₖ = min(samplesₖ / ŵ, 1), McMahan et al. 2018, Alg. 1). Zeroing agent
    k's update changes only its own term, by wₖ·xₖ: ‖ΔA‖ = wₖ·‖xₖ‖ / n ≤ S / n. The denominator n does not
    depend on anyone's data; a denominator Σ wₖ would (one agent's weight would rescale every other term),
    which is why sample-weighted FedAvg's n_k / Σ n_j has no such bound.

    Why n and not the paper's q·W (the expected total weight of a round sampling a fraction q, W = Σ over
    every agent of wₖ): W is a function of every agent's sample count, private data here; q·W is an
    expectation over a secret sample SkyFed does not have (``broker_server.privacy.accountant``); n is public
    already. The price: agents below the cap pull the step toward zero (all at ŵ/2: half a step)."""
    return clip / updates


def trimmed_mean_sensitivity(updates: int, trimmed: int, clip: float) -> float:
    """Coordinate-wise trimmed mean dropping k = ``trimmed`` values at each end and averaging the m = n − 2k
    others (the median is k = ⌊(n−1)/2⌋): Δ = S / m, S / n for k = 0 (the plain mean).

    Proof, per coordinate j: zeroing agent a's update moves one value, xₐⱼ, to 0. Order statistics are
    non-decreasing in every value, so moving one value down (up) moves each of them down (up) or leaves
    it; and together they move by exactly xₐⱼ, since they sum to the values' sum. So the m kept ones move
    by at most |xₐⱼ| together: |ΔAⱼ| ≤ |xₐⱼ| / m, and over all coordinates ‖ΔA‖ ≤ ‖xₐ‖ / m ≤ S / m. It is
    attained: n = 3 values (0, S, S) on one coordinate have median S, and zeroing one S makes it 0.

    What it costs against FedAvg's S / n: a factor n / (n − 2k), about 1/(1 − 2β) for k ≈ βn — 1.25 at
    β = 0.1, 1.67 at β = 0.2. The median (m = 1 or 2) pays n (odd n) or n/2 (even n): its noise is of the
    order of S on every value, whatever the number of agents."""
    return clip / (updates - 2 * trimmed)


def multi_krum_sensitivity(updates: int, keep: int, clip: float) -> float:
    """Multi-Krum's average of the ``keep`` = K best-scored of n updates: Δ = S·min(2(n − K) + 1, 2K) / K.

    One agent can change every score, so the chosen set may change from A (in D) to B (in D'). The n − 1
    updates the neighbours share, U, hold at least |A ∩ U| + |B ∩ U| − (n − 1) updates chosen both times,
    and those cancel in ΔA = (Σ_A x − Σ_B x) / K. Whether the changed agent is chosen in D, in D', both or
    neither, at most 2(n − K) + 1 non-zero updates are left (when it is chosen both times, one of them is
    its zero update in D'), each of norm ≤ S. Both averages also lie in the ball of radius S: ‖ΔA‖ ≤ 2S.
    K = n is the mean (S/n); with K = n − f it is (2f + 1)·S / (n − f): 0.63·S for f = 2 of 10, 6× FedAvg's."""
    return clip * min(2 * (updates - keep) + 1, 2 * keep) / keep
