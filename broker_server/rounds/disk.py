"""Memory never ahead of disk: a state change the server cannot write is undone, said, and tried again.

The round engine changes its state in memory and then writes the checkpoint. If that write fails (a
read-only remount, a full disk), the engine puts back the state it had before (``EngineState.durably``)
and raises ``DiskError``: the previous model and round stay in force, nothing is published, and the
change is tried again later — so a round whose close could not be written closes once the disk is back,
instead of leaving a model in memory that no checkpoint holds (which refused every later update as
``stale-base``). ``DiskWatch`` is the daemon's side: it says "disk: …" once in the log and in
``server/status`` while writes fail, spaces the retries out (no busy loop: the pipeline runs again on
each try), and says when writing works again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

log = logging.getLogger("skyfed.server")

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 5.0


class DiskError(Exception):
    """A state write failed and the engine's memory was put back as it was on disk."""

    def __init__(self, what: str, cause: OSError) -> None:
        super().__init__(f"disk: {what} not written, will retry: {describe(cause)}")


def describe(cause: OSError) -> str:
    """The error and the file it is about: the target of a rename, not its random temporary name (so the
    same failure reads the same on every retry, and is logged once)."""
    path = cause.filename2 or cause.filename
    return f"[Errno {cause.errno}] {cause.strerror}: '{path}'" if cause.strerror and path else str(cause)


class DiskWatch:
    """The last failed state write (for ``server/status``), and when to try again."""

    def __init__(self, writes: Callable[[], int]) -> None:
        self.writes = writes  # state writes that succeeded so far (``EngineState.settled_writes``)
        self.problem = ""
        self.retry_at = 0.0
        self._interval = RETRY_FIRST_S

    def due(self, now: float) -> bool:
        """Whether a change that needs a write may be tried now (always, while the disk works)."""
        return now >= self.retry_at

    @contextmanager
    def writing(self, now: float, change: AbstractContextManager[None] = nullcontext()) -> Iterator[None]:
        """Run a durable ``change`` (``EngineState.durably``: it raises ``DiskError`` once it has undone
        itself). A failure is logged, shown and retried later (the code after the ``with`` runs either
        way); a write that succeeds after failures says the disk is back."""
        written = self.writes()
        try:
            with change:
                yield
        except DiskError as exc:
            if str(exc) != self.problem:
                log.error("%s", exc)
            self.problem = str(exc)
            self.retry_at, self._interval = now + self._interval, min(self._interval * 2, RETRY_MAX_S)
            return
        if self.problem and self.writes() > written:
            log.warning("disk writable again: the state is written (it failed with: %s)", self.problem)
            self.problem, self.retry_at, self._interval = "", 0.0, RETRY_FIRST_S
