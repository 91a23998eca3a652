"""When to ask again for what a broker that went away may have lost (a broker killed mid-round).

A restarted broker keeps only what it had saved (mosquitto's ``autosave_interval``): updates it had
acknowledged to agents but not yet passed to the server are gone, and so, with the server's session,
are the retained model and round task. The agents count those updates as sent; only the server can
miss them. So after every reconnect (not the first connect: the server publishes everything at start)
the daemon re-publishes what a lost session took at once, and ``ASK_AGAIN_AFTER_S`` later re-announces
the open round to the agents it still waits for, its deadline kept. The pause lets what agents re-send
by themselves on reconnecting (paho keeps unacknowledged chunks) arrive first, so it is not sent twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

ASK_AGAIN_AFTER_S = 3.0


@dataclass
class Reconnects:
    """Counts accepted broker connections (from paho's thread) and says, from the loop, what is due."""

    clock: Callable[[], float] = time.monotonic
    accepted: int = 0
    _handled: int = 0
    _ask_at: float | None = None

    def connected(self) -> None:
        """paho's network thread, on every CONNACK that accepted us."""
        self.accepted += 1

    def due(self) -> str:
        """``reconnected`` once per reconnect, ``ask-again`` ``ASK_AGAIN_AFTER_S`` after the last one, or ``""``."""
        now = self.clock()
        if self.accepted > self._handled:
            first = self._handled == 0
            self._handled = self.accepted
            if not first:
                self._ask_at = now + ASK_AGAIN_AFTER_S
                return "reconnected"
        if self._ask_at is not None and now >= self._ask_at:
            self._ask_at = None
            return "ask-again"
        return ""
