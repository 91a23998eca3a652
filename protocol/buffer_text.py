"""How an asynchronous round's buffer (``RoundMetrics.buffer``) and the trained updates a round lost
(``RoundMetrics.wasted``) read on every surface: the sim's console, ``skyfed monitor``, the dashboard and
``skyfed report``."""

from __future__ import annotations

from protocol.typed import finite


def buffer_text(buffer: dict) -> str:
    """``buffer 5/5, 2 late, staleness 0.8 (max 2)``; "" for a synchronous round."""
    if not isinstance(buffer, dict) or not buffer:
        return ""
    late = f", {_number(buffer.get('late'))} late" if buffer.get("late") else ""
    staleness = f", staleness {_number(buffer.get('staleness_mean'))} (max {_number(buffer.get('staleness_max'))})"
    return f"buffer {_number(buffer.get('updates'))}/{_number(buffer.get('size'))}{late}{staleness}"


def _number(value: object) -> str:
    """A count or a mean as received (a metrics topic is public: anything else is shown as ``?``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value):  # 400 digits: not one
        return "?"
    return f"{value:.4g}"


def wasted_text(wasted: dict) -> str:
    """``lost 1 stale, 2 late``: trained updates refused for their timing; "" when none was."""
    if not isinstance(wasted, dict):
        return ""
    parts = [f"{count} {kind}" for kind, count in sorted(wasted.items()) if isinstance(count, int) and count]
    return f"lost {', '.join(parts)}" if parts else ""
