"""Aggregation strategies: one module each, pure arithmetic over flat float32 vectors.

``build_strategy(table)`` builds the one ``[strategy] name`` selects, with the rest of the table as
its options. Every strategy composes with the influence bounds (clipping, sample caps) of
``flcore.bounds``, applied before it sees the updates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.registry import Registry
from flcore.late import late_weight
from flcore.strategies.choice import DEFAULT_STRATEGY

if TYPE_CHECKING:  # imported with the first plug-in: listing the names (CLI choices) stays light
    from flcore.strategies.base import Strategy

STRATEGIES: Registry[type[Strategy]] = Registry("strategy", "strategy.name")
STRATEGIES.add("auto", "flcore.strategies.auto:AutoDefault")
STRATEGIES.add("fedavg", "flcore.strategies.fedavg:FedAvg")
STRATEGIES.add("fedprox", "flcore.strategies.fedprox:FedProx")
STRATEGIES.add("median", "flcore.strategies.median:FedMedian")
STRATEGIES.add("trimmed-mean", "flcore.strategies.trimmed_mean:TrimmedMean")
STRATEGIES.add("krum", "flcore.strategies.krum:MultiKrum")
STRATEGIES.add("centered-clip", "flcore.strategies.centered_clip:CenteredClip")
STRATEGIES.add("fedavgm", "flcore.strategies.server_optimizers:FedAvgM")
STRATEGIES.add("fedadam", "flcore.strategies.server_optimizers:FedAdam")
STRATEGIES.add("fedyogi", "flcore.strategies.server_optimizers:FedYogi")
STRATEGIES.add("fedswap", "flcore.strategies.swapping:ModelSwapping")
STRATEGIES.add("simfedswap", "flcore.strategies.swapping:SimFedSwap")
STRATEGIES.add("demlearn", "flcore.strategies.demlearn:DemLearn")
STRATEGIES.add("fedamp", "flcore.strategies.fedamp:FedAMP")
STRATEGIES.add("fedamn", "flcore.strategies.fedamn:FedAMN")
STRATEGIES.add("ditto", "flcore.strategies.ditto:Ditto")
STRATEGIES.add("fedper", "flcore.strategies.fedper:FedPer")


def build_strategy(table: dict[str, Any]) -> Strategy:
    """The strategy ``table["name"]`` (default ``DEFAULT_STRATEGY``) built from the other keys of ``[strategy]``."""
    options = dict(table)
    name = options.pop("name", DEFAULT_STRATEGY)
    threshold = options.pop("threshold", 0)
    elect_best = options.pop("elect_best", False)
    late = options.pop("late_weight", None)
    if not isinstance(name, str):
        raise ValueError(f"strategy.name must be a string; choose one of {', '.join(STRATEGIES.names())}")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(
            f"strategy.threshold must be a whole number >= 0 (close a round once that many updates are in; "
            f"0 = wait for every selected agent), got {threshold!r}"
        )
    strategy = STRATEGIES.get(name).from_table(options)
    if not isinstance(elect_best, bool):
        raise ValueError(
            f"strategy.elect_best must be true or false (at the end of the run, publish the global model that "
            f"evaluated best), got {elect_best!r}"
        )
    strategy.threshold = threshold
    strategy.elect_best = elect_best
    if strategy.keeps_models and late not in (None, 0):
        raise ValueError(f"strategy.late_weight must be 0 with {name!r}: it keeps every agent's model, and a late "
                         "update was trained from one the agent no longer holds")  # fmt: skip
    strategy.late_weight = 0.0 if strategy.keeps_models else late_weight(late, threshold, where="strategy.late_weight")
    return strategy


__all__ = ["build_strategy", "DEFAULT_STRATEGY", "STRATEGIES"]
