"""Availability traces: when a simulated drone is on the ground and in range (``[gate] availability``).

A real drone's gate opens when it lands and closes when it arms; a sim's agents have no flight controller,
so a trace stands in for the flights: the same gate, closed with ``away: …`` while the trace has the agent
offline, so the server selects only agents that are there and a flight that starts mid-round cancels the
training, exactly as arming does (docs/architecture.md, "Round lifecycle" step 2). Two forms:

- ``flights:on=4m,off=20m[,jitter=1m]``: online for ``on``, away for ``off``, again and again. Each agent
  starts at its own phase and each period varies by up to ± ``jitter``, both drawn from the agent's name:
  the same fleet in every run. Durations take s, m or h (a bare number is seconds).
- the absolute path of a CSV file with the header ``agent,start_s,end_s``: each row an interval, in seconds
  since the fleet's origin, when that agent is online. The trace repeats after its last end.

Times are seconds since the fleet's origin (``gate.availability_origin``: wall-clock Unix seconds the fleet
shares; a sim sets it to its start). Pure: the caller passes the time.
"""

from __future__ import annotations

import bisect
import csv
import random
import re
from dataclasses import dataclass
from pathlib import Path

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
CSV_HEADER = ["agent", "start_s", "end_s"]


def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"4m"``, ``"1.5h"`` → seconds."""
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a duration: write a number with s, m or h, e.g. 4m")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def duration_text(seconds: float) -> str:
    """Seconds the way an operator reads them in a reason: ``45s``, ``12m05s``, ``2h03m``."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Timeline:
    """One agent's toggles: online from ``starts[i]`` to ``ends[i]``, away in between."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def state(self, t: float) -> tuple[bool, float]:
        """``(online, seconds until that changes)`` at ``t`` (the timeline must reach past ``t``)."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and t < self.ends[i]:
            return True, self.ends[i] - t
        return False, self.starts[i + 1] - t


@dataclass(frozen=True)
class Flights:
    """``flights:on=…,off=…,jitter=…``: the synthetic drone pattern."""

    on_s: float
    off_s: float
    jitter_s: float = 0.0

    def __post_init__(self) -> None:
        if self.on_s <= 0 or self.off_s <= 0:
            raise ValueError("flights: on and off must both be longer than 0 (e.g. flights:on=4m,off=20m)")
        if not 0 <= self.jitter_s < min(self.on_s, self.off_s):
            raise ValueError("flights: jitter must be at least 0 and shorter than both on and off")

    def online_fraction(self, agents: list[str]) -> float:
        return self.on_s / (self.on_s + self.off_s)

    def check_agents(self, agents: list[str]) -> None:
        """Every agent has its own phase: nothing to check."""

    def timeline(self, agent: str) -> FlightTimeline:
        return FlightTimeline(self, agent)


class FlightTimeline(Timeline):
    """An agent's flights, generated period by period as time goes on (each one from its own seed, so the
    schedule does not depend on when or how often it is asked)."""

    def __init__(self, flights: Flights, agent: str) -> None:
        super().__init__()
        self.flights, self.agent = flights, agent
        phase = random.Random(f"{agent}/phase").uniform(0.0, flights.on_s + flights.off_s)
        self._next = -phase  # where the next period starts

    def state(self, t: float) -> tuple[bool, float]:
        while not self.starts or self.starts[-1] <= t:  # one period past t, for the time left away
            f, k = self.flights, len(self.starts)
            rng = random.Random(f"{self.agent}/{k}")
            on = f.on_s + rng.uniform(-f.jitter_s, f.jitter_s)
            self.starts.append(self._next)
            self.ends.append(self._next + on)
            self._next += on + f.off_s + rng.uniform(-f.jitter_s, f.jitter_s)
        return super().state(t)


@dataclass(frozen=True)
class Intervals:
    """A CSV of per-agent online intervals; it repeats every ``period_s`` (its last end)."""

    path: str
    rows: dict[str, tuple[tuple[float, float], ...]]
    period_s: float

    @classmethod
    def read(cls, path: str) -> Intervals:
        if not path.startswith("/"):
            raise ValueError(f"an availability CSV must be an absolute path, got {path!r}")
        try:
            with Path(path).open(newline="") as f:
                reader = csv.reader(f)
                header = [h.strip() for h in next(reader, [])]
                if header != CSV_HEADER:
                    raise ValueError(f"{path}: the first line must be {','.join(CSV_HEADER)}, got {','.join(header)!r}")
                found: dict[str, list[tuple[float, float]]] = {}
                for line, row in enumerate(reader, start=2):
                    if not row or not "".join(row).strip():
                        continue
                    found.setdefault(row[0].strip(), []).append(interval(path, line, row))
        except OSError as exc:
            raise ValueError(f"cannot read the availability CSV {path}: {exc.strerror}") from None
        if not found:
            raise ValueError(f"{path}: no intervals after the header")
        period = max(end for spans in found.values() for _, end in spans)
        return cls(path, {agent: merged(spans) for agent, spans in found.items()}, period)

    def online_fraction(self, agents: list[str]) -> float:
        online = sum(end - start for a in agents for start, end in self.rows.get(a, ()))
        return online / (self.period_s * len(agents)) if agents else 0.0

    def check_agents(self, agents: list[str]) -> None:
        """An agent the file never names would never train: refuse it at start."""
        if missing := [a for a in agents if a not in self.rows]:
            raise ValueError(f"{self.path} has no intervals for {', '.join(missing)}: add rows for every agent")

    def timeline(self, agent: str) -> IntervalTimeline:
        return IntervalTimeline(self.rows.get(agent, ()), self.period_s)


class IntervalTimeline(Timeline):
    """An agent's rows of the CSV, repeated every period."""

    def __init__(self, spans: tuple[tuple[float, float], ...], period_s: float) -> None:
        super().__init__()
        self.period_s = period_s
        for shift in (-period_s, 0.0, period_s):  # the period before and after, so every lookup has neighbours
            self.starts += [start + shift for start, _ in spans]
            self.ends += [end + shift for _, end in spans]

    def state(self, t: float) -> tuple[bool, float]:
        if not self.starts:
            return False, float("inf")
        return super().state(t % self.period_s)


def interval(path: str, line: int, row: list[str]) -> tuple[float, float]:
    try:
        start, end = float(row[1]), float(row[2])
    except (IndexError, ValueError):
        got = ",".join(row)
        raise ValueError(f"{path} line {line}: expected agent,start_s,end_s with numbers, got {got!r}") from None
    if not 0 <= start < end < float("inf"):
        raise ValueError(f"{path} line {line}: need 0 <= start_s < end_s, got {start:g}, {end:g}")
    return start, end


def merged(spans: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Overlapping or touching intervals as one."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)


Trace = Flights | Intervals


def parse_availability(spec: str) -> Trace:
    """``flights:on=4m,off=20m,jitter=1m`` or ``/abs/path.csv``; ``ValueError`` says what to write instead."""
    if spec.startswith("flights:"):
        values: dict[str, float] = {}
        for part in spec.removeprefix("flights:").split(","):
            key, _, value = part.partition("=")
            if key.strip() not in ("on", "off", "jitter") or not value:
                raise ValueError(f"flights takes on=, off= and jitter=, got {part!r} (e.g. flights:on=4m,off=20m)")
            values[key.strip()] = parse_duration(value)
        if "on" not in values or "off" not in values:
            raise ValueError("flights needs on= and off= (e.g. flights:on=4m,off=20m)")
        return Flights(values["on"], values["off"], values.get("jitter", 0.0))
    if spec.endswith(".csv") or spec.startswith("/"):
        return Intervals.read(spec)
    raise ValueError(f"{spec!r}: write flights:on=4m,off=20m[,jitter=1m] or the absolute path of a CSV trace")


class Availability:
    """One agent's trace from the fleet's origin: the gate asks ``reason(wall)`` ("" while online)."""

    def __init__(self, trace: Trace, agent: str, origin: float) -> None:
        self.origin = origin
        self.timeline = trace.timeline(agent)

    def reason(self, wall: float) -> str:
        online, left = self.timeline.state(wall - self.origin)
        if online:
            return ""
        back = "never" if left == float("inf") else f"back in {duration_text(left)}"
        return f"away: the availability trace has this agent offline ({back})"
