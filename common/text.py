"""Untrusted strings on their way into a log line, a metrics field or a terminal: one line, bounded, no escapes.

A reason string can carry text an agent chose (a codec name, a tensor name, its whole status); written as
is, a newline would forge a second log line under journald, an ANSI/OSC escape would repaint, clear or
write the clipboard of the operator's terminal, and a bidi override would show text reversed. Every
character that is not printable (C0 and C1 controls with ESC among them, format characters such as the
bidi overrides, separators other than the space) is shown as its Python escape, so the text stays readable
and no sequence survives.
"""

from __future__ import annotations

import logging


def printable(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters with every control character shown as an escape."""
    cut = text[:limit]
    if cut.isprintable():
        return cut
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)


LOG_MESSAGE_LIMIT = 4000  # characters of one log message; a traceback after it is the logger's own text


class PrintableFormatter(logging.Formatter):
    """Every log message one printable line, whatever its arguments carried; tracebacks stay multi-line."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = printable(record.message, LOG_MESSAGE_LIMIT)
        return super().formatMessage(record)
