"""What the sources last reported: plain frozen values, so the gate can be a pure function of them.

Times are ``time.monotonic()`` seconds (immune to the wall clock jumping when GPS or NTP sets it).
"""

from __future__ import annotations

from dataclasses import dataclass

ARMED = "armed"
BATTERY = "battery_pct"
CHARGING = "charging"
TEMPERATURE = "temperature_c"


@dataclass(frozen=True)
class SourceReading:
    """One source's latest values; None means it has not said (yet).

    ``measures`` names what the source can report (``ARMED``, ``BATTERY``, ...), so the gate knows which
    sources a condition depends on; ``heard_at`` is when its last valid message arrived (None: never).
    """

    source: str
    measures: frozenset[str]
    heard_at: float | None = None
    armed: bool | None = None
    battery_pct: float | None = None
    charging: bool | None = None
    temperature_c: float | None = None
    hottest: str = ""  # where temperature_c was measured, e.g. "thermal_zone1 CPU-therm"

    def summary(self, now: float) -> dict[str, object]:
        """The known values and their age, for the agent's status (``telemetry``)."""
        values = {k: getattr(self, k) for k in (ARMED, BATTERY, CHARGING, TEMPERATURE) if getattr(self, k) is not None}
        if self.hottest:
            values["hottest"] = self.hottest
        values["age_s"] = None if self.heard_at is None else round(now - self.heard_at, 1)
        return values


@dataclass(frozen=True)
class Readings:
    """Every configured source's reading, taken together."""

    sources: tuple[SourceReading, ...] = ()

    def summary(self, now: float) -> dict[str, dict[str, object]]:
        return {s.source: s.summary(now) for s in self.sources}
