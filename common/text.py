"""Untrusted strings on their way into a log line or a metrics field: one line, bounded, no escapes.

A reason string can carry text an agent chose (a codec name, a tensor name); written as is, a newline
would forge a second log line under journald and an ANSI escape would repaint a terminal.
"""

from __future__ import annotations


def printable(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters with every control character shown as an escape."""
    cut = text[:limit]
    if cut.isprintable():
        return cut
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
