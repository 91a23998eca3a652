"""Aggregation strategies: one module each, pure arithmetic over flat float32 vectors.

``build_strategy(table)`` builds the one ``[strategy] name`` selects, with the rest of the table as
its options. Every strategy composes with the influence bounds (clipping, sample caps) of
``flcore.bounds``, applied before it sees the updates.
"""

from __future__ import annotations

from typing import Any

from flcore.strategies.auto import AutoDefault
from flcore.strategies.base import Contribution, RoundResult, Strategy
from flcore.strategies.centered_clip import CenteredClip
from flcore.strategies.choice import DEFAULT_STRATEGY
from flcore.strategies.demlearn import DemLearn
from flcore.strategies.fedamn import FedAMN
from flcore.strategies.fedamp import FedAMP
from flcore.strategies.fedavg import FedAvg
from flcore.strategies.fedprox import FedProx
from flcore.strategies.krum import MultiKrum
from flcore.strategies.median import FedMedian
from flcore.strategies.server_optimizers import FedAdam, FedAvgM, FedYogi
from flcore.strategies.swapping import ModelSwapping, SimFedSwap
from flcore.strategies.trimmed_mean import TrimmedMean

_ALL = (AutoDefault, FedAvg, FedProx, FedMedian, TrimmedMean, MultiKrum, CenteredClip, FedAvgM, FedAdam, FedYogi)
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (*_ALL, ModelSwapping, SimFedSwap, DemLearn, FedAMP,
                                                                      FedAMN)}


def build_strategy(table: dict[str, Any]) -> Strategy:
    """The strategy ``table["name"]`` (default ``DEFAULT_STRATEGY``) built from the other keys of ``[strategy]``."""
    options = dict(table)
    name = options.pop("name", DEFAULT_STRATEGY)
    threshold = options.pop("threshold", 0)
    elect_best = options.pop("elect_best", False)
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"strategy.name {name!r} is unknown; choose one of {', '.join(sorted(STRATEGIES))}")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(
            f"strategy.threshold must be a whole number >= 0 (close a round once that many updates are in; "
            f"0 = wait for every selected agent), got {threshold!r}"
        )
    strategy = STRATEGIES[name].from_table(options)
    if not isinstance(elect_best, bool):
        raise ValueError(
            f"strategy.elect_best must be true or false (at the end of the run, publish the global model that "
            f"evaluated best), got {elect_best!r}"
        )
    strategy.threshold = threshold
    strategy.elect_best = elect_best
    return strategy


__all__ = ["Contribution", "RoundResult", "Strategy", "build_strategy", "DEFAULT_STRATEGY", "STRATEGIES"]
