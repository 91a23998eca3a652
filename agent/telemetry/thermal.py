"""Temperatures from Linux thermal zones (``/sys/class/thermal/thermal_zone*/temp``, millidegrees C).

Read on demand, no thread: a few small sysfs files. The zone list is listed again at most once a minute (a
loop asks every tick; listing sysfs each time was a hot spot in a host of 100 agents). The hottest zone
counts. Zones that fail to read (some sensors return EINVAL or ENODATA while powered down), read
implausibly, or whose ``type`` is in ``ignore`` (Jetson's ``PMIC-Die`` always reads 100 °C, a placeholder
below its 120 °C alarm) are skipped.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from agent.telemetry.readings import TEMPERATURE, SourceReading

log = logging.getLogger("skyfed.agent.telemetry")

PLAUSIBLE_C = (-60.0, 200.0)
RESCAN_S = 60.0  # zones come and go only with drivers


class ThermalZones:
    name = "thermal"

    def __init__(self, directory: str, ignore: tuple[str, ...] = ()) -> None:
        self.directory = Path(directory)
        self.ignore = frozenset(ignore)
        self._zones: list[Path] = []
        self._listed_at = -RESCAN_S
        log.info("telemetry thermal: %d zones in %s", len(self.zones()), self.directory)

    def zones(self) -> list[Path]:
        now = time.monotonic()
        if now - self._listed_at >= RESCAN_S:
            self._zones, self._listed_at = sorted(self.directory.glob("thermal_zone*")), now
        return self._zones

    def reading(self) -> SourceReading:
        """The hottest zone now; ``heard_at`` is None when no zone could be read."""
        hottest: tuple[float, str] | None = None
        for zone in self.zones():
            try:
                kind = (zone / "type").read_text().strip()
                celsius = int((zone / "temp").read_text()) / 1000
            except (OSError, ValueError):
                continue
            if kind in self.ignore or not PLAUSIBLE_C[0] <= celsius <= PLAUSIBLE_C[1]:
                continue
            if hottest is None or celsius > hottest[0]:
                hottest = (celsius, f"{zone.name} {kind}".strip())
        if hottest is None:
            return SourceReading(self.name, frozenset({TEMPERATURE}))
        return SourceReading(
            self.name, frozenset({TEMPERATURE}), heard_at=time.monotonic(), temperature_c=hottest[0], hottest=hottest[1]
        )
