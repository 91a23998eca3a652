"""What both daemons share: signals, start-up errors, and the one loop they run (logging: ``common.logs``).

``MqttDaemon.run`` is the only event loop in SkyFed: drain received MQTT messages, call ``tick``
between them, and on stop publish a final retained status. Every handler runs under ``guard``: an
exception is logged (the same failure at most once a minute), counted in ``errors`` (which the daemons
put in their status), and survived. A daemon exits only on a signal, when its work is done, or at
start on a configuration error (exit code 2, which the systemd units treat as "do not restart").
Under systemd (``Type=notify``) the loop says READY=1 once the broker first accepted it, WATCHDOG=1
as it turns (so a hung loop is restarted), what it is doing in STATUS=, and STOPPING=1; it stops
within a second of a signal even when the broker is gone.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import paho.mqtt.client as paho

from common.logs import Throttle
from common.sdnotify import Notifier
from protocol.config import ConfigError
from protocol.mqtt import MqttClient

TICK_INTERVAL_S = 0.1
# A signal to exit within 2 s: the loop notices within a tick, then these two waits at most, then the interpreter exits.
FINAL_STATUS_WAIT_S = 0.5  # the broker's PUBACK of the last status (sent before the DISCONNECT either way)
NETWORK_STOP_WAIT_S = 0.5  # paho's thread sending the DISCONNECT; with the broker gone it may be mid-reconnect


def quiet_connection_logs() -> None:
    """Interactive commands print their own output; the MQTT and broker start-up lines are noise there."""
    for name in ("skyfed.mqtt", "skyfed.sim.broker"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


class SignalStop(threading.Event):
    """Set by a signal, whose name it keeps (``SIGTERM``): a daemon's last log line says why it stopped."""

    def __init__(self) -> None:
        super().__init__()
        self.signal_name = ""

    def receive(self, signum: int, _frame: object = None) -> None:
        self.signal_name = signal.Signals(signum).name
        self.set()


def stop_on_signals() -> SignalStop:
    """SIGTERM (systemd stop) and SIGINT set the returned event; daemons then shut down cleanly."""
    stop = SignalStop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop.receive)
    return stop


class Daemon(Protocol):
    """What ``run_daemon`` runs: one ``MqttDaemon``, or several loops run as one (``region.daemon.Region``)."""

    def run(self, stop: threading.Event | None = None) -> None: ...


def run_daemon(name: str, build: Callable[[], Daemon]) -> int:
    """Build a daemon (a bad config or unreadable file exits 2), then run it until a signal."""
    try:
        daemon = build()
    except (ConfigError, ValueError, OSError) as exc:
        logging.getLogger(f"skyfed.{name}").error("cannot start: %s", exc)  # stderr: the terminal or the journal
        return 2
    # What is loaded by now (PyTorch, the model) lives as long as the process: keep it out of every later
    # garbage collection, including the ones at exit, which otherwise take the server over a second.
    gc.freeze()
    daemon.run(stop_on_signals())
    return 0


class MqttDaemon(ABC):
    """The loop, the guard and the final status; subclasses say what to subscribe, handle and do."""

    def __init__(self, mqtt: MqttClient, log: logging.Logger) -> None:
        self.mqtt = mqtt
        self.log = log
        self.errors = 0
        self._error_log = Throttle()
        self.notifier = Notifier()
        self._ready = False
        self.tick_interval_s = TICK_INTERVAL_S  # longer where many daemons share a process (sim.agent_host)

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

    @abstractmethod
    def progress_fields(self) -> str:
        """Where the daemon stands, as ``key=value`` fields (``round=3 model_version=2``), for its stop line."""

    def on_start(self) -> None:  # noqa: B027 - optional hook
        """After connecting has begun, before the first message."""

    def on_stop(self) -> None:  # noqa: B027 - optional hook
        """After the final status and the disconnect: release what the daemon holds open (an HTTP endpoint)."""

    def finished(self) -> bool:
        return False

    def systemd_status(self) -> str:
        """The line ``systemctl status`` shows (STATUS=), e.g. ``round 3: training``; the loop adds the
        connection problem when there is one, and asks after every tick, so keep it cheap. This default
        says only how the connection stands."""
        where = f"{self.mqtt.at.host}:{self.mqtt.at.port}"  # the node of the current attempt (a cluster: any)
        return f"connected to {where}" if self.mqtt.connected.is_set() else f"connecting to {where}"

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
                message = self.mqtt.poll(self.tick_interval_s)
                if message is not None:
                    self.guard(f"message on {message[0]}", self.handle, *message)
                now = time.monotonic()
                if message is None or now - last_tick >= self.tick_interval_s:
                    last_tick = now
                    self.guard("tick", self.tick)
                    self.guard("systemd notification", self._notify_systemd)
        finally:
            self._shut_down()
            if isinstance(stop, SignalStop) and stop.signal_name:  # one line that says why the journal ends here
                self.log.info("stopped on %s %s", stop.signal_name, self.progress_fields())

    def _notify_systemd(self) -> None:
        """WATCHDOG=1 as the loop turns, READY=1 once the broker first accepted us, STATUS= when it changed."""
        self.notifier.keep_alive(starting=not self._ready)
        if not self._ready and self.mqtt.connected.is_set():
            self.notifier.send("READY=1")
            self._ready = True
        text = self.systemd_status()
        if self.mqtt.problem is not None:
            text = f"{text}; unreachable: {self.mqtt.problem}"
        self.notifier.status(text)

    def _shut_down(self) -> None:
        """STOPPING=1, the final retained status, then disconnect, each wait bounded: with the broker gone,
        nothing queued can go out, so nothing is waited for."""
        self.notifier.status("stopping", "STOPPING=1")
        try:
            last = self.publish_final_status()
            if last is not None and self.mqtt.connected.is_set():
                MqttClient.wait_published([last], FINAL_STATUS_WAIT_S)
        finally:
            if not self.mqtt.stop(NETWORK_STOP_WAIT_S):
                self.log.info("stopped without the MQTT network thread, which was still trying to reconnect")
            self.notifier.close()
            self.guard("stop", self.on_stop)
