"""One line per event, on stderr: journald's priorities under systemd, a timestamp elsewhere, and ``Throttle`` for
events that may repeat. Its own module, so a command that only checks a config does not import the daemons'
MQTT client to set up its logging."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

from common.text import PrintableFormatter

ERROR_LOG_INTERVAL_S = 60.0


def configure_logging(level: str, *, thread_names: bool = False) -> None:
    """One line per event. Into the journal, each line starts with its syslog priority (``<4>`` for a
    warning: ``journalctl -p warning`` finds it, a traceback included) and journald adds the time;
    anywhere else we do. ``thread_names`` prefixes each line with its thread's name (several daemons in
    one process)."""
    fmt = "%(levelname)s %(name)s: %(message)s"
    if thread_names:
        fmt = "[%(threadName)s] " + fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter(fmt) if stderr_is_journal() else PrintableFormatter("%(asctime)s " + fmt))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])


def stderr_is_journal() -> bool:
    """Whether stderr is the journal stream systemd connected (``$JOURNAL_STREAM`` is its device:inode;
    a child whose stderr went elsewhere inherits the variable, not the stream)."""
    device, _, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        stat = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # closed, replaced by a non-file, or absent
        return False
    return device.isdigit() and inode.isdigit() and (int(device), int(inode)) == (stat.st_dev, stat.st_ino)


class JournalFormatter(PrintableFormatter):
    """Every line of a record prefixed with the record's syslog priority, which journald strips and keeps."""

    PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        priority = self.PRIORITIES.get(record.levelno, 6)
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines() or [""])


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
