"""The flight controller over MAVLink on a serial port: armed flag, battery charge, charging.

Only pymavlink's generated ``common`` dialect is imported (its parser: 6 MB resident on top of the
agent's own imports), not ``mavutil``, which pulls in numpy and a class for every transport (28 MB). The parser
takes MAVLink 1 and 2 frames in any mix; bytes that do not parse are counted and skipped.

Which messages count:
- HEARTBEAT from the autopilot: ``base_mode & MAV_MODE_FLAG_SAFETY_ARMED``. Heartbeats from a ground
  station (``MAV_TYPE_GCS``) or another component (``MAV_AUTOPILOT_INVALID``: cameras, gimbals,
  companion computers) are ignored. The first autopilot heard after (re)opening the port is followed;
  messages from other systems on a shared radio link are ignored.
- SYS_STATUS ``battery_remaining`` (-1 = unknown, ignored) and BATTERY_STATUS of battery 0, the one
  SYS_STATUS reports too: ``battery_remaining`` and ``charge_state`` (CHARGING, or not; UNDEFINED leaves
  charging unknown).
The autopilot must stream SYS_STATUS (ArduPilot: ``SRn_EXT_STAT`` ≥ 1 on that port; PX4 streams it);
the agent never writes to the flight controller.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pymavlink.dialects.v20 import common as mavlink

from agent.telemetry.readings import ARMED, BATTERY, CHARGING
from agent.telemetry.serial_link import RETRY_S, SerialSource

log = logging.getLogger("skyfed.agent.telemetry")


class MavlinkSource(SerialSource):
    """Listens to a flight controller on ``device``; ``reading()`` is its latest state."""

    name = "mavlink"

    def __init__(self, device: str, baud: int, *, retry_s: float = RETRY_S) -> None:
        self._parser = self._new_parser()
        self._system: int | None = None
        self.bad_frames = 0  # garbage or corrupt frames skipped (noise on the line, a wrong baud rate)
        super().__init__(device, baud, frozenset({ARMED, BATTERY, CHARGING}), retry_s=retry_s)

    @staticmethod
    def _new_parser() -> mavlink.MAVLink:
        parser = mavlink.MAVLink(None)
        parser.robust_parsing = True  # bad bytes come back as BAD_DATA, never as an exception
        return parser

    def _reset(self) -> None:
        self._parser = self._new_parser()
        self._system = None

    def feed(self, data: bytes) -> None:
        """Parse bytes from the port (called by the reader thread)."""
        for message in self._parser.parse_buffer(data) or []:
            if message.get_type() == "BAD_DATA":
                self.bad_frames += 1
            else:
                self._handle(message)

    def _handle(self, message: mavlink.MAVLink_message) -> None:
        kind, system = message.get_type(), message.get_srcSystem()
        if kind == "HEARTBEAT":
            if message.type == mavlink.MAV_TYPE_GCS or message.autopilot == mavlink.MAV_AUTOPILOT_INVALID:
                return
            if self._system is None:
                self._system = system
                log.info("telemetry mavlink: following autopilot system %d", system)
            if system == self._system:
                self._update(armed=bool(message.base_mode & mavlink.MAV_MODE_FLAG_SAFETY_ARMED))
        elif system != self._system:
            return
        elif kind == "SYS_STATUS" and message.battery_remaining >= 0:
            self._update(battery_pct=float(message.battery_remaining))
        elif kind == "BATTERY_STATUS" and message.id == 0:
            values: dict[str, object] = {}
            if message.battery_remaining >= 0:
                values["battery_pct"] = float(message.battery_remaining)
            if message.charge_state != mavlink.MAV_BATTERY_CHARGE_STATE_UNDEFINED:
                values["charging"] = message.charge_state == mavlink.MAV_BATTERY_CHARGE_STATE_CHARGING
            self._update(**values)

    def _update(self, **values: object) -> None:
        now = time.monotonic()
        with self._lock:
            previous = self._reading
            self._reading = dataclasses.replace(previous, heard_at=now, **values)
        if "armed" in values and values["armed"] != previous.armed:
            log.info("telemetry mavlink: %s", "armed" if values["armed"] else "disarmed")
