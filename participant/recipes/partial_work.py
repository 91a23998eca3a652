"""Partial work: a slow device runs only a share of its epochs' mini-batches (at least one), so it reports in time
instead of being dropped (FedProx's answer to systems heterogeneity, Li et al. 2020, Section 5.2). The server sets
the share per participant from its measured pace (``broker_server.rounds.pace``, docs/strategies.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from participant.recipes.base import Knobs, Recipe


@dataclass(frozen=True)
class PartialWorkOptions:
    share: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"share must be in (0, 1] (of the local epochs), got {self.share}")


class PartialWork(Recipe):
    name = "partial-work"
    Options = PartialWorkOptions
    trainers = frozenset({"classifier", "detector"})  # Ultralytics' ``fraction`` of the training images

    def knobs(self, knobs: Knobs) -> Knobs:
        return replace(knobs, work=self.options.share)
