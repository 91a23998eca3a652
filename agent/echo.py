"""Does what this agent publishes reach anyone? Its own retained status must come back to it.

With mosquitto, a publish its ACL denies is acknowledged all the same (MQTT 3.1.1 has no way to say no),
so an agent the broker's ACL does not name yet (``skyfed provision`` added it, nobody reloaded mosquitto)
logs "mqtt connected" and sends into the void. The agent subscribes to its own status topic; a status it
published that has not come back within ``ECHO_TIMEOUT_S`` while connected means the broker drops it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

ECHO_TIMEOUT_S = 30.0  # statuses go out every status_interval_s (10 s by default) and come back in milliseconds
MAX_PENDING = 64


def dropped_text(agent: str, timeout_s: float) -> str:
    return (
        f"the broker drops what this agent publishes: its own status did not come back within {timeout_s:.0f} s "
        f"(mosquitto acknowledges what its ACL denies): the broker's ACL likely does not name {agent!r} yet; "
        "after skyfed provision added it: systemctl reload mosquitto on the broker host (an ACL from an older "
        "skyfed provision lets agents write but not read their status: provision again, then reload)"
    )


class PublishEcho:
    def __init__(self, timeout_s: float = ECHO_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.dropped = False  # said so, and nothing came back since
        self._pending: set[bytes] = set()
        self._since: float | None = None  # when the oldest status still unseen went out while connected

    def sent(self, payload: bytes) -> None:
        if len(self._pending) < MAX_PENDING:
            self._pending.add(hashlib.sha256(payload).digest())
        if self._since is None:
            self._since = self.clock()

    def came_back(self, payload: bytes) -> bool:
        """Note a message on the agent's own status topic; True when it ends a spell of dropped publishes."""
        if hashlib.sha256(payload).digest() not in self._pending:
            return False  # an older retained status, or someone else's: proves nothing
        self._pending.clear()
        self._since = None
        ended, self.dropped = self.dropped, False
        return ended

    def overdue(self, connected: bool) -> bool:
        """True once when a status has not come back for ``timeout_s`` of connected time."""
        if not connected:
            self._since = None  # queued by paho; the clock restarts with the status sent on reconnecting
            return False
        if self.dropped or self._since is None or self.clock() - self._since < self.timeout_s:
            return False
        self.dropped = True
        return True
