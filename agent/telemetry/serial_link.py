"""A serial device read in a daemon thread that survives the device vanishing and coming back.

USB serial adapters disappear on a bad cable or a reboot of the other side; flight controllers reset.
The link never raises into the agent: a failure is one warning (then at most one a minute while it
persists), the readings go stale so the gate closes, and the device is reopened every ``retry_s``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import serial

from agent.telemetry.readings import SourceReading
from common.logs import Throttle

log = logging.getLogger("skyfed.agent.telemetry")

READ_TIMEOUT_S = 0.2  # how long a read blocks, so stop() returns within this
RETRY_S = 2.0


class SerialLink:
    """Hands every chunk of bytes read from ``device`` to ``feed``; ``on_open`` runs at each (re)open so
    the caller can drop half a message left from the previous connection."""

    def __init__(
        self,
        name: str,
        device: str,
        baud: int,
        feed: Callable[[bytes], None],
        on_open: Callable[[], None],
        *,
        retry_s: float = RETRY_S,
    ) -> None:
        self.name, self.device, self.baud = name, device, baud
        self.feed, self.on_open, self.retry_s = feed, on_open, retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = Throttle()

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"telemetry-{self.name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=READ_TIMEOUT_S + 2.0)
            self._thread = None

    def _warn(self, what: str, exc: BaseException, *, trace: bool = False) -> None:
        held = self._log.allow(what)
        if held is not None:
            log.warning("telemetry %s: %s %s: %s; retrying every %g s held_back=%d",
                        self.name, what, self.device, exc, self.retry_s, held, exc_info=trace)  # fmt: skip

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                port = serial.Serial(self.device, self.baud, timeout=READ_TIMEOUT_S)
            except (OSError, ValueError) as exc:  # SerialException is an OSError; ValueError: a bad baud rate
                self._warn("cannot open", exc)
                self._stop.wait(self.retry_s)
                continue
            log.info("telemetry %s: reading %s at %d baud", self.name, self.device, self.baud)
            self.on_open()
            try:
                with port:
                    while not self._stop.is_set():
                        data = port.read(port.in_waiting or 1)
                        if data:
                            self.feed(data)
            except OSError as exc:  # unplugged, or the other end of a pty closed
                self._warn("lost", exc)
            except Exception as exc:  # a bug in a parser must not end the thread: the readings would freeze
                self._warn("failed reading", exc, trace=True)
            self._stop.wait(self.retry_s)


class SerialSource:
    """Base of the serial telemetry sources: a ``SerialLink`` feeding ``feed`` and a reading behind a lock.
    Subclasses set ``name`` and implement ``feed(data)`` and ``_reset()`` (the port was (re)opened)."""

    name = ""

    def __init__(self, device: str, baud: int, measures: frozenset[str], *, retry_s: float = RETRY_S) -> None:
        self._lock = threading.Lock()
        self._reading = SourceReading(self.name, measures)
        self.link = SerialLink(self.name, device, baud, self.feed, self._reset, retry_s=retry_s)

    def feed(self, data: bytes) -> None:
        raise NotImplementedError

    def _reset(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.link.start()

    def stop(self) -> None:
        self.link.stop()

    def reading(self) -> SourceReading:
        with self._lock:
            return self._reading
