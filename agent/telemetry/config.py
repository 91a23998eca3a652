"""``[gate]`` and ``[telemetry]`` of ``agent.toml``: when this device may train, and where it learns its state.

Both tables are optional and default to "no gate": a bench device with nothing configured trains whenever
it is selected. Values are checked here so a typo in a quiet-hours range or a relative device path stops
the agent at start, not at the first round.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.telemetry.availability import parse_availability

_RANGE = re.compile(r"^(\d\d):(\d\d)-(\d\d):(\d\d)$")


def quiet_range(text: str) -> tuple[int, int]:
    """``"22:00-06:00"`` → minutes after midnight ``(1320, 360)``; the end may be ``24:00``, and a range
    whose end comes before its start crosses midnight. Raises ``ValueError`` for anything else."""
    match = _RANGE.match(text)
    if not match:
        raise ValueError('expected "HH:MM-HH:MM" in local time, e.g. "22:00-06:00"')
    sh, sm, eh, em = map(int, match.groups())
    if sh > 23 or sm > 59 or em > 59 or eh > 24 or (eh == 24 and em):
        raise ValueError("hours run 00-23 (the end may be 24:00) and minutes 00-59")
    start, end = sh * 60 + sm, eh * 60 + em
    if start == end:
        raise ValueError('start and end are the same time; for the whole day write "00:00-24:00"')
    return start, end


@dataclass(frozen=True)
class GatePolicy:
    """``[gate]``: the conditions under which this agent skips a round (each one off by default).

    A condition needs a source in ``[telemetry]`` (``check_gate_sources``); the armed check is on by default
    but applies only when a flight controller is configured, since a device without one cannot fly.
    """

    min_battery_pct: float = 0.0  # skip below this charge; 0 = off
    require_charging: bool = False  # train only while on the charger
    allow_armed: bool = False  # train while the flight controller is armed (in flight): almost never wanted
    max_temperature_c: float = 0.0  # skip above this (hottest thermal zone or power board); 0 = off
    quiet_hours: tuple[str, ...] = ()  # local-time ranges such as "22:00-06:00" (may cross midnight)
    stale_after_s: float = 10.0  # a needed source silent this long closes the gate (fail closed)
    availability: str = ""  # a sim's drone pattern or CSV trace (agent.telemetry.availability); "" = off
    availability_origin: float = 0.0  # the fleet's time zero for the trace, Unix seconds; 0 = this agent's start

    def __post_init__(self) -> None:
        if not 0 <= self.min_battery_pct <= 100:
            raise ValueError(f"gate.min_battery_pct must be in 0..100 (0 = off), got {self.min_battery_pct}")
        if not 0 <= self.max_temperature_c <= 150:
            raise ValueError(f"gate.max_temperature_c must be in 0..150 °C (0 = off), got {self.max_temperature_c}")
        if self.stale_after_s <= 0:
            raise ValueError(f"gate.stale_after_s must be > 0 seconds, e.g. 10, got {self.stale_after_s}")
        if self.availability_origin < 0:
            raise ValueError(f"gate.availability_origin must be Unix seconds >= 0 (0 = the agent's start), "
                             f"got {self.availability_origin}")
        if self.availability:
            try:
                parse_availability(self.availability)
            except ValueError as exc:
                raise ValueError(f"gate.availability = {self.availability!r}: {exc}") from None
        for i, text in enumerate(self.quiet_hours):
            try:
                quiet_range(text)
            except ValueError as exc:
                raise ValueError(f"gate.quiet_hours[{i}] = {text!r}: {exc}") from None


@dataclass(frozen=True)
class TelemetrySection:
    """``[telemetry]``: where the device state comes from. An empty string turns a source off.

    The agent only ever listens: it never writes to the flight controller or the power board.
    """

    mavlink: str = ""  # flight controller serial device, e.g. "/dev/ttyTHS1"; MAVLink 1 or 2
    mavlink_baud: int = 57600
    power_serial: str = ""  # power board serial device sending lines like "battery=87 charging=1 temp=41.5"
    power_baud: int = 115200
    thermal_zones: str = "/sys/class/thermal"  # sysfs directory of thermal_zone*/temp; "" = off
    thermal_ignore: tuple[str, ...] = ("PMIC-Die",)  # zone types that do not measure (Jetson's PMIC-Die reads 100 °C)

    def __post_init__(self) -> None:
        examples = {"mavlink": "/dev/ttyTHS1", "power_serial": "/dev/ttyUSB0", "thermal_zones": "/sys/class/thermal"}
        for key, example in examples.items():
            value = getattr(self, key)
            if value and not value.startswith("/"):
                raise ValueError(f'telemetry.{key} must be an absolute path like "{example}" ("" = off), got {value!r}')
        for key in ("mavlink_baud", "power_baud"):
            baud = getattr(self, key)
            if baud <= 0:
                raise ValueError(f"telemetry.{key} must be a positive baud rate such as 57600, got {baud}")


def check_gate_sources(gate: GatePolicy, telemetry: TelemetrySection) -> None:
    """Refuse a policy that no configured source can ever satisfy (it would skip every round, silently)."""
    battery = "telemetry.mavlink or telemetry.power_serial"
    if gate.min_battery_pct and not (telemetry.mavlink or telemetry.power_serial):
        raise ValueError(f"gate.min_battery_pct = {gate.min_battery_pct:g} needs a battery source: set {battery}")
    if gate.require_charging and not (telemetry.mavlink or telemetry.power_serial):
        raise ValueError(f"gate.require_charging = true needs a charging source: set {battery}")
    if gate.max_temperature_c and not (telemetry.thermal_zones or telemetry.power_serial):
        raise ValueError(
            f"gate.max_temperature_c = {gate.max_temperature_c:g} needs a temperature source: "
            'set telemetry.thermal_zones (e.g. "/sys/class/thermal") or telemetry.power_serial'
        )


def check_availability(gate: GatePolicy, agent: str) -> None:
    """Refuse a CSV trace without rows for this agent (it would never train)."""
    if gate.availability:
        try:
            parse_availability(gate.availability).check_agents([agent])
        except ValueError as exc:
            raise ValueError(f"gate.availability: {exc}") from None
