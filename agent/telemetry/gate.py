"""The gate: why this agent must not train right now, as a pure function of policy, readings and time.

Every reason is a short stable string, ``key: detail``, published in the agent's status (``gate.reasons``)
so an operator sees why a drone sits out; no reason means ready. The gate fails closed: a condition whose
source is silent, stale or has not reported yet is a reason too. Where several sources report the same
quantity the cautious one wins: the lowest battery, the hottest sensor, charging only if all agree.
It never reads a clock itself.
"""

from __future__ import annotations

import datetime as dt

from agent.telemetry.config import GatePolicy, quiet_range
from agent.telemetry.readings import ARMED, BATTERY, CHARGING, TEMPERATURE, Readings, SourceReading

MISSING = {ARMED: "armed state", BATTERY: "battery reading", CHARGING: "charging state", TEMPERATURE: "temperature"}


def needed(policy: GatePolicy, readings: Readings) -> set[str]:
    """What the policy reads. Armed counts only when a source can report it (a device without a flight
    controller cannot fly); every other condition fails closed even without a source."""
    wanted = {
        ARMED: not policy.allow_armed and any(ARMED in s.measures for s in readings.sources),
        BATTERY: policy.min_battery_pct > 0,
        CHARGING: policy.require_charging,
        TEMPERATURE: policy.max_temperature_c > 0,
    }
    return {key for key, on in wanted.items() if on}


def in_quiet_hours(text: str, local: dt.time) -> bool:
    start, end = quiet_range(text)
    minute = local.hour * 60 + local.minute + local.second / 60
    return start <= minute < end if start < end else minute >= start or minute < end


def gate_reasons(policy: GatePolicy, readings: Readings, now: float, local: dt.time) -> list[str]:
    """Why not to train now (empty: ready). ``now`` is monotonic seconds (the clock of ``heard_at``),
    ``local`` the local time of day for quiet hours."""
    wanted = needed(policy, readings)
    reasons: list[str] = []
    fresh: list[SourceReading] = []
    explained: set[str] = set()  # quantities whose only source went stale: the stale reason says it
    for source in readings.sources:
        if not source.measures & wanted:
            continue
        if source.heard_at is not None and now - source.heard_at > policy.stale_after_s:
            reasons.append(f"telemetry-stale: {source.source} silent for {now - source.heard_at:.0f} s")
            explained |= source.measures
        else:
            fresh.append(source)

    def known(key: str) -> list[tuple[float, SourceReading]]:
        return [(getattr(s, key), s) for s in fresh if getattr(s, key) is not None]

    for key in (ARMED, BATTERY, CHARGING, TEMPERATURE):
        if key in wanted and not known(key) and key not in explained:
            reasons.append(f"telemetry-missing: no {MISSING[key]} yet")
    if ARMED in wanted and any(armed for armed, _ in known(ARMED)):
        reasons.append("armed: the flight controller reports armed")
    if BATTERY in wanted and known(BATTERY):
        lowest = min(pct for pct, _ in known(BATTERY))
        if lowest < policy.min_battery_pct:
            reasons.append(f"battery-low: {lowest:g}% < {policy.min_battery_pct:g}%")
    if CHARGING in wanted and known(CHARGING) and not all(charging for charging, _ in known(CHARGING)):
        reasons.append("not-charging")
    if TEMPERATURE in wanted and known(TEMPERATURE):
        hottest, source = max(known(TEMPERATURE), key=lambda pair: pair[0])
        if hottest > policy.max_temperature_c:
            where = source.hottest or source.source
            reasons.append(f"too-hot: {hottest:.1f} °C > {policy.max_temperature_c:g} °C ({where})")
    reasons += [f"quiet-hours: {text}" for text in policy.quiet_hours if in_quiet_hours(text, local)]
    return reasons
