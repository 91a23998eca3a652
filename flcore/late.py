"""A late update folded into the next round, discounted for its staleness, instead of refused.

With SmartFed's static threshold (``[strategy] threshold = K``) a round closes at its K-th update; an agent whose
update always comes after the K-th (a slower device, or only a busier machine) never counted. Now an update for
the round that closed last, from an agent that round selected and closed without, is checked exactly as an on-time
one (signature and replay at the transfer, structure against the model version it was trained from, finite
values, the norm limit, the model's invariants over that model) and folded into the open round as one more
contribution, through the same influence bounds and screening. It joins as its *model*: the change from the model
in force to the late agent's model (its delta plus the step the model took since), as FedAsync mixes a stale
model into the current one (Xie, Koyejo & Gupta, "Asynchronous Federated Optimization", 2019, arXiv:1903.03934)
and as a peer always takes a change over its own model (``agent.peer.collect``). Its raw delta added to the new
model would apply the late agent's step a second time and can break the model's invariants (a BatchNorm running
variance pushed below zero: measured, a NaN trial loss on the digits CNN); a weighted mean of valid models cannot.

Its weight, after the bounds, is multiplied by ``late_weight``: by default FedAsync's polynomial staleness
function (1 + s)^-a with a = 1/2 at staleness s = 1, 2^-1/2 ≈ 0.71. An update two or more rounds old is refused as
``stale``; ``late_weight = 0`` keeps the old rule (every late update refused). A threshold of K still means K: a
late update never counts towards the open round's K. A strategy that ignores weights (``weighting = "uniform"``,
the median, Krum) ignores the discount too: the late model is then one more among the round's.
"""

from __future__ import annotations

import math

DEFAULT_LATE_WEIGHT = round(2**-0.5, 6)  # (1 + s)^-a at s = 1, a = 1/2 (FedAsync's polynomial form)


def late_weight(value: object, threshold: int, *, where: str) -> float:
    """The factor a late update's weight is multiplied by: ``value`` as configured (``None``: not set, so the
    default with a threshold and 0 without one); ``ValueError`` naming ``where`` when it is not in [0, 1]."""
    if value is None:
        return DEFAULT_LATE_WEIGHT if threshold > 0 else 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value <= 1 and math.isfinite(value)):
        raise ValueError(
            f"{where} must be a number in [0, 1] (a late update of the round before is folded into the next with "
            f"its weight times this; 0 = refuse late updates), got {value!r}"
        )
    return float(value)


def late_refusal(round_number: int, current: int, *, folding: bool, owed: bool) -> str:
    """Why an update for ``round_number``, older than the ``current`` round, is refused ("" if it is folded in):
    with ``folding`` on, one for the round just before is folded when that round closed without its sender
    (``owed``); one older than that is stale."""
    if folding and round_number < current - 1:
        return f"stale: round {round_number} is {current - round_number} rounds behind the current {current}"
    if folding and owed and round_number == current - 1:
        return ""
    return f"late: round {round_number} is closed, current is {current}"
