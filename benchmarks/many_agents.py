"""``python -m benchmarks.many_agents``: memory and time to the first round of N agents on one machine.

Each case is a real ``skyfed sim`` (broker, server, agents over MQTT) of one round. While it runs, the
private memory (``Private_Clean + Private_Dirty`` of ``/proc/<pid>/smaps_rollup``) of every process
the run started is summed every 0.25 s; the peak is reported, with the time from the start of the run
to the first round's metrics. Baseline in the same run: one process per agent (``skyfed agent run``),
at N = 10 only — at 50 it would need about 18 GB. Long (minutes): not part of ``make bench``; results
go to docs/results/many_agents.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import report
from sim.federation import SimSettings
from sim.run import run_sim


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def smaps_bytes(pid: int, fields: tuple[str, ...] = ("Private_Clean", "Private_Dirty")) -> int:
    """The sum of ``fields`` of ``/proc/<pid>/smaps_rollup`` in bytes (default: its private memory; 0 once gone)."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in lines if line.split(":")[0] in fields)


class PeakMemory:
    """Samples the summed private memory of this process's descendants until stopped."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self.peak = max(self.peak, sum(smaps_bytes(pid) for pid in _descendants(os.getpid())))

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(agents: int, per_process: int) -> dict:
    settings = SimSettings(
        agents=agents,
        rounds=1,
        epochs=1,
        agents_per_process=per_process,
        federation="many",
        deadline_s=300.0,
        partition="iid",  # 1,437 digits over 100 agents: a skewed split would leave some with too few
    )
    with tempfile.TemporaryDirectory() as folder, PeakMemory() as memory:
        started = time.time()
        result = run_sim(settings, Path(folder), echo=lambda _line: None)
    first = result.metrics[0]
    return {
        "agents": agents,
        "agents_per_process": per_process,
        "processes": -(-agents // per_process),
        "peak_private_mb": round(memory.peak / 1e6),
        "first_round_s": round(first.finished_at - started, 1),
        "accepted": len(first.accepted),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.many_agents", description=__doc__)
    parser.add_argument("--agents", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--per-process", type=int, default=25)
    args = parser.parse_args(argv)
    baseline = measure(10, 1)
    report("agents, one process each (baseline)", target="(reported)", ok=True, **baseline)
    for count in args.agents:
        row = measure(count, min(args.per_process, count))
        ratio = row["peak_private_mb"] / baseline["peak_private_mb"]
        report(
            f"{count} agents, {row['agents_per_process']} per process",
            target="100 agents over the real broker on this machine",
            ok=row["accepted"] == count,
            memory_vs_10_separate=round(ratio, 2),
            **row,
        )


if __name__ == "__main__":
    main()
