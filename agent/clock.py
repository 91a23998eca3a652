"""This device's clock against the server's, measured on the signed times of round tasks.

Every round task carries the server's signed ``issued_at``. When a task arrives the agent notes its own
clock minus that time. A task delivered from the broker's retained store may be minutes old, so one
sample cannot tell a skewed clock from an old task; a live task arrives within a second of being
issued, so the smallest offset over the last few distinct tasks is the estimate, and it counts once
two tasks gave one. A replayed task cannot shrink it: an older task is refused before it is measured,
and only the server can sign a time in the future. Beyond ``TOLERANCE_S`` the agent logs "clock skew"
once, reports the offset in its status (``clock_offset_s``) and judges task times on the server's
clock (its own minus the offset): a device whose clock runs ahead trains instead of dropping every
task as expired, and the operator is told to fix its time sync. Its updates are signed at that time
too, or the server would refuse every one as ``from-the-future``. Replay protection keeps: the server
judges a transfer's age on its own clock and remembers its id as long as that accepts it; the offset is
at least the true one (a delivery delay only adds), so a corrected time is never later than the
server's. Its statuses keep the device's own clock: the server measures the skew on them, and a
status must be newer than the last (``broker_server.agents.registry``).
"""

from __future__ import annotations

import logging

from protocol.messages import RoundTask

log = logging.getLogger("skyfed.agent")
TOLERANCE_S = 30.0  # offsets within this are network delay and ordinary drift: not corrected
SAMPLES_KEPT = 8


class ClockSkew:
    def __init__(self) -> None:
        self.samples: dict[tuple[str, int, int], float] = {}  # (run, round, attempt) -> local minus issued_at

    def observe(self, task_key: tuple[str, int, int], issued_at: float, now: float) -> bool:
        """Note one task's offset; True when that changes whether the clock counts as skewed."""
        before = self.skewed
        self.samples.setdefault(task_key, now - issued_at)
        while len(self.samples) > SAMPLES_KEPT:
            del self.samples[next(iter(self.samples))]
        return self.skewed != before

    def note_task(self, task: RoundTask, now: float) -> bool:
        """Measure ``task``'s signed time, saying so when that starts or ends the skew (True then)."""
        if not self.observe((task.run_id, task.round, task.attempt), task.issued_at, now):
            return False
        if self.skewed:
            log.warning("clock skew offset_s=%+.1f: this device's clock is off the server's signed task times; "
                        "judging deadlines on the server's time: fix its time sync (NTP)", self.offset_s)  # fmt: skip
        else:
            log.info("clock skew gone offset_s=%+.1f", self.offset_s)
        return True

    @property
    def offset_s(self) -> float:
        """This clock minus the server's (0 until two tasks were measured)."""
        return min(self.samples.values()) if len(self.samples) >= 2 else 0.0

    @property
    def skewed(self) -> bool:
        return abs(self.offset_s) > TOLERANCE_S

    def server_time(self, now: float) -> float:
        """``now`` on the server's clock, where this one is known to be off by more than the tolerance."""
        return now - self.offset_s if self.skewed else now
