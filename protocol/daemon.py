"""What both daemons share: logging, signals, start-up errors, and the one loop they run.

``MqttDaemon.run`` is the only event loop in SkyFed: drain received MQTT messages, call ``tick``
between them, and on stop publish a final retained status. Every handler runs under ``guard``: an
exception is logged (the same failure at most once a minute), counted in ``errors`` (which the daemons
put in their status), and survived. A daemon exits only on a signal, when its work is done, or at
start on a configuration error (exit code 2, which the systemd units treat as "do not restart").
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import paho.mqtt.client as paho

from protocol.config import ConfigError
from protocol.mqtt import MqttClient

ERROR_LOG_INTERVAL_S = 60.0
TICK_INTERVAL_S = 0.1


def configure_logging(level: str, *, thread_names: bool = False) -> None:
    """One line per event; journald adds its own timestamps (it sets JOURNAL_STREAM), anywhere else we do.
    ``thread_names`` prefixes each line with its thread's name (several daemons in one process)."""
    fmt = "%(levelname)s %(name)s: %(message)s"
    if thread_names:
        fmt = "[%(threadName)s] " + fmt
    if not os.environ.get("JOURNAL_STREAM"):
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr)


def quiet_connection_logs() -> None:
    """Interactive commands print their own output; the MQTT and broker start-up lines are noise there."""
    for name in ("skyfed.mqtt", "skyfed.sim.broker"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def stop_on_signals() -> threading.Event:
    """SIGTERM (systemd stop) and SIGINT set the returned event; daemons then shut down cleanly."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def run_daemon(name: str, build: Callable[[], MqttDaemon]) -> int:
    """Build a daemon (a bad config or unreadable file exits 2), then run it until a signal."""
    try:
        daemon = build()
    except (ConfigError, ValueError, OSError) as exc:
        logging.getLogger(f"skyfed.{name}").error("cannot start: %s", exc)  # stderr: the terminal or the journal
        return 2
    daemon.run(stop_on_signals())
    return 0


class Throttle:
    """At most one log line per key per ``interval_s``; the next line says how many were held back."""

    def __init__(self, interval_s: float = ERROR_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __len__(self) -> int:
        """How many keys it currently remembers."""
        return len(self._last)

    def allow(self, key: str) -> int | None:
        """None to stay quiet; otherwise the number of lines held back since the last one for ``key``."""
        now = self.clock()
        if now - self._last.get(key, -self.interval_s) < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if len(self._last) > 10_000:  # hostile input must not grow this without bound
            self._last.clear()
            self._held.clear()
        self._last[key] = now
        return self._held.pop(key, 0)


class MqttDaemon(ABC):
    """The loop, the guard and the final status; subclasses say what to subscribe, handle and do."""

    def __init__(self, mqtt: MqttClient, log: logging.Logger) -> None:
        self.mqtt = mqtt
        self.log = log
        self.errors = 0
        self._error_log = Throttle()

    @abstractmethod
    def subscriptions(self) -> list[str]: ...

    @abstractmethod
    def handle(self, topic: str, payload: bytes) -> None:
        """One received message."""

    @abstractmethod
    def tick(self) -> None:
        """Timers and work between messages (round deadlines, training)."""

    @abstractmethod
    def publish_final_status(self) -> paho.MQTTMessageInfo | None:
        """The retained status a clean stop leaves behind."""

    def connection_state(self, state: str, detail: str) -> tuple[str, str]:
        """``unreachable`` and the reason in words while the broker cannot be used (a refused
        subscription, say; a status queued while disconnected goes out once it can publish)."""
        problem = self.mqtt.problem
        if problem is None:
            return state, detail
        return "unreachable", f"{problem}; {detail}" if detail else problem

    def on_start(self) -> None:  # noqa: B027 - optional hook
        """After connecting has begun, before the first message."""

    def finished(self) -> bool:
        return False

    def guard(self, what: str, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn``; an exception is logged (once a minute per kind), counted, and survived."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the last line of defence of a long-running daemon
            self.errors += 1
            held = self._error_log.allow(f"{what}:{type(exc).__name__}:{exc}")
            if held is not None:
                self.log.exception("internal error in %s errors=%d held_back=%d", what, self.errors, held)

    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        for pattern in self.subscriptions():
            self.mqtt.subscribe(pattern)
        self.mqtt.start()
        self.guard("start", self.on_start)
        last_tick = 0.0
        try:
            while not stop.is_set() and not self.finished():
                message = self.mqtt.poll(TICK_INTERVAL_S)
                if message is not None:
                    self.guard(f"message on {message[0]}", self.handle, *message)
                now = time.monotonic()
                if message is None or now - last_tick >= TICK_INTERVAL_S:
                    last_tick = now
                    self.guard("tick", self.tick)
        finally:
            try:
                last = self.publish_final_status()
                if last is not None:
                    MqttClient.wait_published([last], 5)
            finally:
                self.mqtt.stop()
