"""A tiny sd_notify(3) client, so systemd (``Type=notify``) learns when a daemon is ready, alive, stopping,
and what it is doing.

The protocol is one datagram of ``KEY=value`` lines to the AF_UNIX socket named by ``$NOTIFY_SOCKET``
(a leading ``@`` means Linux's abstract namespace); systemd reads the sender's credentials from the
kernel, so nothing else is sent. ``$WATCHDOG_USEC`` says systemd expects ``WATCHDOG=1`` within that
time, from ``$WATCHDOG_PID`` when set (so a child that inherited the variables stays out of it); the
man page recommends pinging at half of it. Without ``$NOTIFY_SOCKET`` (a terminal, the sim, tests)
every call does nothing. It must never raise into the daemon or block it: a send that fails is
dropped, with one log line when sending starts failing.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping

from common.text import printable

log = logging.getLogger("skyfed.systemd")

STATUS_MAX_CHARS = 300


def _address(value: str) -> bytes | None:
    """The socket address of ``$NOTIFY_SOCKET``: a path, or ``@name`` for an abstract socket."""
    if value.startswith("/"):
        return os.fsencode(value)
    if value.startswith("@") and len(value) > 1:
        return b"\0" + os.fsencode(value[1:])
    if value:
        log.warning("NOTIFY_SOCKET=%s is not an AF_UNIX address; systemd will not hear from this daemon", value)
    return None


def _watchdog_s(environ: Mapping[str, str], pid: int) -> float | None:
    """systemd's watchdog interval in seconds when it is meant for ``pid``, else None."""
    usec, owner = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (owner and owner != str(pid)):
        return None
    return int(usec) / 1e6


class Notifier:
    """Notifications for the service manager of this process; see the module docstring."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        pid: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        environ = os.environ if environ is None else environ
        self.address = _address(environ.get("NOTIFY_SOCKET", ""))
        self.watchdog_s = _watchdog_s(environ, os.getpid() if pid is None else pid) if self.address else None
        self.clock = clock
        self._socket: socket.socket | None = None
        self._failing = False
        self._last_ping = -math.inf
        self._status: str | None = None

    def send(self, *assignments: str) -> bool:
        """One datagram of ``KEY=value`` lines; False when it did not go (or there is no service manager)."""
        if self.address is None:
            return False
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._socket.sendto("\n".join(assignments).encode(), socket.MSG_DONTWAIT, self.address)
        except OSError as exc:
            if not self._failing:
                log.warning("sd_notify failed (%s): systemd may miss READY, WATCHDOG or STATUS", exc)
            self._failing = True
            return False
        self._failing = False
        return True

    def keep_alive(self, *, starting: bool = False) -> None:
        """``WATCHDOG=1`` every half watchdog interval. While ``starting`` (not READY yet) it also extends
        the start timeout by one interval: a daemon still waiting for its broker stays "activating", and
        one whose loop hung still fails."""
        if self.watchdog_s is None or self.clock() - self._last_ping < self.watchdog_s / 2:
            return
        self._last_ping = self.clock()
        extend = [f"EXTEND_TIMEOUT_USEC={round(self.watchdog_s * 1e6)}"] if starting else []
        self.send("WATCHDOG=1", *extend)

    def status(self, text: str, *extra: str) -> None:
        """``STATUS=text`` (one printable line) when it changed, or whenever ``extra`` assignments go along."""
        text = printable(text, STATUS_MAX_CHARS)
        if text != self._status or extra:
            self._status = text
            self.send(*extra, f"STATUS={text}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
