"""A power board (or any microcontroller) on a serial port, sending one line of ``key=value`` pairs at a time.

    battery=87 charging=1 temp=41.5

Known keys: ``battery`` (percent, 0-100), ``charging`` (1/0, true/false), ``temp`` (°C). Pairs are separated
by spaces or commas; unknown keys are ignored, so a board may send more (``volts=12.1``). A line that does
not parse (no ``=``, a bad number, out of range, not ASCII, longer than ``MAX_LINE`` bytes) is counted in
``malformed`` and skipped whole: half a line must never pass for a reading.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

from agent.telemetry.readings import BATTERY, CHARGING, TEMPERATURE
from agent.telemetry.serial_link import RETRY_S, SerialSource

log = logging.getLogger("skyfed.agent.telemetry")

MAX_LINE = 256
_SEPARATORS = re.compile(r"[\s,]+")
_BOOLS = {"1": True, "0": False, "true": True, "false": False}


def _percent(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 100:
        raise ValueError(f"battery {text} is not a percentage")
    return value


def _celsius(text: str) -> float:
    value = float(text)
    if not -60 <= value <= 200:
        raise ValueError(f"temp {text} is not a plausible °C")
    return value


def _charging(text: str) -> bool:
    if text.lower() not in _BOOLS:
        raise ValueError(f"charging {text!r} is not 1/0 or true/false")
    return _BOOLS[text.lower()]


KEYS = {"battery": (BATTERY, _percent), "charging": (CHARGING, _charging), "temp": (TEMPERATURE, _celsius)}


def parse_line(line: str) -> dict[str, float | bool]:
    """``"battery=87 charging=1"`` → ``{"battery_pct": 87.0, "charging": True}``; ``ValueError`` if malformed."""
    values: dict[str, float | bool] = {}
    for pair in _SEPARATORS.split(line.strip()):
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r} is not key=value")
        if key in KEYS:
            field, convert = KEYS[key]
            values[field] = convert(text)
    return values


class LineSerialSource(SerialSource):
    """Reads ``key=value`` lines from ``device``; ``reading()`` is the latest value of each key."""

    name = "power_serial"

    def __init__(self, device: str, baud: int, *, retry_s: float = RETRY_S) -> None:
        self._buffer = bytearray()
        self._overlong = False  # inside a line that passed MAX_LINE: skip it up to its newline
        self.malformed = 0
        super().__init__(device, baud, frozenset({BATTERY, CHARGING, TEMPERATURE}), retry_s=retry_s)

    def _reset(self) -> None:
        self._buffer.clear()  # a first line cut at its start is harmless: a key always precedes its value
        self._overlong = False

    def feed(self, data: bytes) -> None:
        """Split bytes from the port into lines (called by the reader thread)."""
        self._buffer += data
        *lines, rest = self._buffer.split(b"\n")
        self._buffer = bytearray(rest)
        for raw in lines:
            if self._overlong:
                self._overlong = False
            elif len(raw) > MAX_LINE:
                self._bad(raw, "longer than MAX_LINE")
            else:
                self._line(raw)
        if len(self._buffer) > MAX_LINE:
            if not self._overlong:
                self._bad(self._buffer, "longer than MAX_LINE")
            self._buffer.clear()
            self._overlong = True

    def _line(self, raw: bytes) -> None:
        try:
            text = raw.decode("ascii").strip()
            if not text:
                return
            values = parse_line(text)
        except ValueError as exc:  # UnicodeDecodeError is a ValueError
            self._bad(raw, str(exc))
            return
        now = time.monotonic()
        with self._lock:
            self._reading = dataclasses.replace(self._reading, heard_at=now, **values)

    def _bad(self, raw: bytes | bytearray, why: str) -> None:
        self.malformed += 1
        if self.malformed == 1 or self.malformed % 100 == 0:
            log.warning("telemetry power_serial: skipped malformed line %r (%s) malformed=%d",
                        bytes(raw[:40]), why, self.malformed)  # fmt: skip
