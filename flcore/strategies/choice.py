"""The default aggregation, and what the server says at start about the strategy it runs.

The default was chosen by measurement (docs/results/robustness.md, "Choosing the default
aggregation"): 10 agents, digits, 10 rounds, IID, Dirichlet 0.5, Dirichlet 0.1 and 2-label shards, with
and without 2 attackers of every kind. No single strategy met both targets, so the default adapts
(``strategies.auto``): Krum where the fleet is big enough for its f and the agents' updates agree (data
alike, where Krum holds against attackers and costs nothing clean), centered clipping otherwise (the only
candidate within 1 point of FedAvg with no attacker on every split; it needs no count of attackers, so it
protects a fleet of 3 as it does one of 10).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from flcore.rounds import RoundRules

DEFAULT_STRATEGY = "auto"


@dataclass(frozen=True)
class StrategyNote:
    """One line for the server's log at start, at ``level`` (``logging.INFO`` or ``logging.WARNING``)."""

    level: int
    text: str


def updates_per_round(enrolled: int, rules: RoundRules) -> int:
    """How many updates a full round brings (``rounds.select_agents`` with every enrolled agent eligible)."""
    return min(enrolled, max(rules.min_agents, math.ceil(rules.fraction * enrolled)))


def krum_f_used(f: int, updates: int) -> int:
    """Krum's guarantee needs ``updates >= 2f + 3``; below that f is lowered to what the round allows."""
    return min(f, max((updates - 3) // 2, 0))


def strategy_notes(table: dict[str, Any], enrolled: int, rules: RoundRules) -> list[StrategyNote]:
    """What the server should say at start about ``[strategy]`` given ``enrolled`` agents."""
    updates = updates_per_round(enrolled, rules)
    name = table.get("name")
    notes = []
    if name in (None, "auto"):
        notes.append(StrategyNote(logging.INFO, auto_plan(table, enrolled, updates)))
    if name == "krum":
        f = int(table.get("f", 2))
        used = krum_f_used(f, updates)
        if used < f:
            protection = "no protection: every update is averaged" if used == 0 else f"protection from {used} only"
            notes.append(StrategyNote(logging.WARNING, (
                f"strategy krum f={f} needs {2 * f + 3} updates a round; with {enrolled} agents enrolled ({updates} "
                f"updates a round) f is lowered to {used}: {protection}. Enrol more agents, lower strategy.f, or "
                f"remove strategy.name for the default ({DEFAULT_STRATEGY})")))  # fmt: skip
    return notes


def auto_plan(table: dict[str, Any], enrolled: int, updates: int) -> str:
    """What the adaptive default (``strategies.auto``) will do with this fleet, and why."""
    f, threshold = int(table.get("f", 2)), float(table.get("agreement", 0.7))
    default = "default: " if "name" not in table else ""
    head = f"aggregation {default}auto ({enrolled} agents enrolled, {updates} updates a round)"
    if updates < 2 * f + 3:
        return (f"{head}: centered-clip every round while rounds bring fewer than {2 * f + 3} updates (Krum "
                f"f={f}'s minimum); it needs no count of attackers and stays within 1 point of FedAvg on skewed "
                f"data")  # fmt: skip
    return (f"{head}: Krum f={f} if the agents' updates agree >= {threshold:g} in the first round of {2 * f + 3} "
            f"or more (data alike: Krum holds against attackers there), else centered-clip (skewed data: Krum would "
            f"drop honest agents with rare labels); the choice is logged when measured")  # fmt: skip
