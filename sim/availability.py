"""``skyfed sim --availability SPEC``: a fleet that comes and goes (agent.telemetry.availability).

Every agent's agent.toml gets the trace in its ``[gate]`` with the run's start as the fleet's origin, so each
agent's own gate opens and closes on it, as a drone's does on landing and take-off, with a server and with
regions (a peer run ends once every peer has run every round, so it refuses a trace that would keep one away).
A synchronous server that waited for all its agents to be online would never start, so a round starts once as
many agents are there as the trace expects online on average, and closes on half of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.telemetry.availability import parse_availability


def absolute_spec(spec: str) -> str:
    """A CSV trace named relative to the user's folder, made absolute (each agent runs in its own)."""
    if not spec or spec.startswith("flights:") or spec.startswith("/"):
        return spec
    return str(Path(spec).resolve())


def check_spec(spec: str, agents: list[str]) -> None:
    try:
        parse_availability(spec).check_agents(agents)
    except ValueError as exc:
        raise ValueError(f"--availability: {exc}") from None


def gate_table(spec: str, origin: float) -> dict[str, Any]:
    """``{"gate": {...}}`` for an agent.toml (nothing without a trace); ``origin``: the fleet's time zero."""
    return {"gate": {"availability": spec, "availability_origin": origin}} if spec else {}


def round_sizes(spec: str, agents: list[str], selected: int) -> dict[str, int]:
    """``[rounds]`` ``min_agents`` and ``quorum`` for ``selected`` agents a round: every one online to start, or
    under a trace as many as it expects online on average (at least one); half of those to close."""
    needed = max(1, round(parse_availability(spec).online_fraction(agents) * selected)) if spec else selected
    return {"min_agents": needed, "quorum": max(1, needed // 2)}


def describe(spec: str, agents: list[str], asynchronous: bool = False) -> list[str]:
    """The console's line about the trace at start (an asynchronous round opens on the first agent online)."""
    if not spec:
        return []
    share = parse_availability(spec).online_fraction(agents)
    start = 1 if asynchronous else round_sizes(spec, agents, len(agents))["min_agents"]
    return [f"availability: {spec} (each agent online {share:.0%} of the time; rounds start on {start})"]
