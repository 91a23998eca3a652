"""Timing helpers shared by the benchmarks: medians of repeated runs, results as one JSON line each."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def report(name: str, *, target: str, ok: bool, **figures: float | int | str) -> dict:
    row = {"benchmark": name, **figures, "target": target, "meets_target": ok}
    print(json.dumps(row))
    return row
