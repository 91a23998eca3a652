"""(ε, δ) of composed Gaussian mechanisms, with Google's dp-accounting (Rényi DP, ``REPLACE_SPECIAL``): what the
privacy ledger (``broker_server.privacy.accountant``) charges, and what the config check
(``broker_server.privacy.policy``) asks of one round. A module of its own so that both can use it without
importing each other. dp-accounting (with the SciPy it loads) takes a second to import: only a run that
computes an ε pays it, not every server and check that imports this module.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4096)
def epsilon_of(charges: tuple[tuple[float, int], ...], delta: float) -> float:
    """(ε at ``delta``) of Gaussian mechanisms composed: ``charges`` = ((noise multiplier, rounds), …)."""
    if not charges:
        return 0.0
    import dp_accounting
    from dp_accounting.privacy_accountant import NeighboringRelation

    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)
    for noise_multiplier, rounds in charges:
        accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)
    return float(accountant.get_epsilon(delta))
