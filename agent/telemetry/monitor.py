"""``Telemetry``: the configured sources together, and the gate over their readings.

The daemon builds one from ``[telemetry]`` and ``[gate]``, starts it once, asks ``reasons()`` before a round
and puts them in its status; while a training job runs it keeps asking between polls and cancels the job
when a reason appears (arming mid-round), so no update leaves; it stops it at exit. ``reasons()`` costs
tens of microseconds and never raises.
"""

from __future__ import annotations

import datetime as dt
import time

from agent.telemetry.availability import Availability, parse_availability
from agent.telemetry.config import GatePolicy, TelemetrySection
from agent.telemetry.gate import gate_reasons
from agent.telemetry.power import LineSerialSource
from agent.telemetry.readings import Readings
from agent.telemetry.serial_link import RETRY_S, SerialSource
from agent.telemetry.thermal import ThermalZones


class Telemetry:
    """Start with ``start()`` (or ``with``); safe to read from any thread."""

    def __init__(
        self, section: TelemetrySection, policy: GatePolicy, *, agent: str = "", retry_s: float = RETRY_S
    ) -> None:
        self.policy = policy
        self.availability = None  # a sim's flights in place of a flight controller (agent.telemetry.availability)
        if policy.availability:
            origin = policy.availability_origin or time.time()
            self.availability = Availability(parse_availability(policy.availability), agent, origin)
        self.serial: list[SerialSource] = []
        if section.mavlink:
            from agent.telemetry.mavlink import MavlinkSource  # its dialect costs ~6 MB: only when configured

            self.serial.append(MavlinkSource(section.mavlink, section.mavlink_baud, retry_s=retry_s))
        if section.power_serial:
            self.serial.append(LineSerialSource(section.power_serial, section.power_baud, retry_s=retry_s))
        self.thermal = ThermalZones(section.thermal_zones, section.thermal_ignore) if section.thermal_zones else None

    def start(self) -> Telemetry:
        for source in self.serial:
            source.start()
        return self

    def stop(self) -> None:
        for source in self.serial:
            source.stop()

    def __enter__(self) -> Telemetry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def snapshot(self) -> Readings:
        readings = [source.reading() for source in self.serial]
        if self.thermal is not None:
            readings.append(self.thermal.reading())
        return Readings(tuple(readings))

    def reasons(self) -> list[str]:
        """Why this agent must not train now; empty when it may."""
        reasons = gate_reasons(self.policy, self.snapshot(), time.monotonic(), dt.datetime.now().time())
        if self.availability is not None and (away := self.availability.reason(time.time())):
            reasons.append(away)
        return reasons

    def summary(self) -> dict[str, dict[str, object]]:
        """Each source's values and age, for the agent's status (``telemetry``)."""
        return self.snapshot().summary(time.monotonic())
