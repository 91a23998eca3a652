"""``Standing``, where an edge node's role stands: what a role gives its shell (``agent.edge_node``) after every
tick and the shell's Prometheus metrics (``agent.prometheus``) show, below both."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Standing:
    """Where a role stands, as its Prometheus gauges show it: its state (time in ``training`` is counted), its
    round, the last round it completed and why its gate is closed (empty: open)."""

    state: str
    round: int
    last_completed_round: int
    gate: tuple[str, ...] = ()
