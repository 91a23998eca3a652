"""Aggregation strategies: one module each, pure arithmetic over flat float32 vectors.

``build_strategy(name)`` is the registry the server config uses.
"""

from __future__ import annotations

from broker_server.strategies.base import AcceptedUpdate, RoundResult, Strategy
from broker_server.strategies.fedavg import FedAvg

STRATEGIES: dict[str, type[Strategy]] = {FedAvg.name: FedAvg}


def build_strategy(name: str, **options: object) -> Strategy:
    """The strategy called ``name`` (ServerConfig ``strategy.name``)."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"strategy.name {name!r} is unknown; choose one of {sorted(STRATEGIES)}") from None
    return cls(**options)  # type: ignore[arg-type]


__all__ = ["AcceptedUpdate", "RoundResult", "Strategy", "build_strategy", "STRATEGIES"]
