"""``skyfed sim --availability SPEC``: a fleet that comes and goes (agent.telemetry.availability).

Every agent's agent.toml gets the trace in its ``[gate]`` with the run's start as the fleet's origin, so each
agent's own gate opens and closes on it, as a drone's does on landing and take-off, in every shape of run
(server and agents, peers, regions). A synchronous server that waited for all its agents to be online would
never start, so rounds start and close on half the agents the trace expects online.
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
    """``[rounds]`` ``min_agents`` and ``quorum`` for ``selected`` agents a round: every one online to start and
    half of them to close, or under a trace half of those it expects online (at least one)."""
    if not spec:
        return {"min_agents": selected, "quorum": max(1, selected // 2)}
    needed = max(1, int(parse_availability(spec).online_fraction(agents) * selected / 2))
    return {"min_agents": needed, "quorum": needed}


def describe(spec: str, agents: list[str]) -> list[str]:
    """The console's line about the trace at start."""
    if not spec:
        return []
    share = parse_availability(spec).online_fraction(agents)
    return [f"availability: {spec} (each agent online {share:.0%} of the time; rounds start on "
            f"{round_sizes(spec, agents, len(agents))['min_agents']})"]
