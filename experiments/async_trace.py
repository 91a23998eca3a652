"""Synchronous rounds against buffered asynchronous ones (``--async``, FedBuff) on a fleet that comes and goes.

Run: ``python -m experiments.async_trace --out runs/async [--seeds 0,1,2] [--arms sync,k5] [--traces trace]``
(results: docs/results/async.md). Every run is a real ``skyfed sim`` (real daemons over a real mosquitto, 5 agents
per process); the grid runs seed by seed, each seed's arms back to back, so that the machine's load is alike for
the runs compared. An interrupted grid resumes from ``<out>/runs.jsonl``; ``--summary`` only prints the tables.

Measured per run from its ``metrics.jsonl``: when each round closed (seconds since the federation started), the
server's accuracy, bytes up and down, updates folded (on time and late) and trained updates lost (refused late or
stale). The comparison (``summarise``): synchronous rounds' final accuracy is the mean of its last 3 rounds; each
run's time to reach it, as a multiple of the synchronous run's whole wall time, same trace and seed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from sim.federation import SimSettings
from sim.run import run_sim

COMMON = {"agents": 20, "agents_per_process": 5, "partition": "dirichlet:0.3", "rounds": 20,
          "strategy": {"name": "fedavg"}}  # FedBuff averages; the default (auto: Krum, centered clipping) would not
TRACES = {"trace": "flights:on=1m,off=3m,jitter=20s", "no trace": ""}  # online 25 % of the time
BIG = {"agents": 100, "agents_per_process": 25, "partition": "iid"}  # digits has too few samples for Dirichlet 0.3
PRIVATE = {**BIG, "strategy": {"name": "fedavg", "weighting": "uniform"}, "rounds": 10,
           "privacy": {"clip": 1.0, "noise_multiplier": 4.73, "target_epsilon": 3.0}}  # docs/results/privacy.md's best
ASYNC = {"asynchronous": True, "buffer": 5, "rounds": 40}  # 200 updates: sync's 20 rounds take up to ~10 each
ARMS = {  # name -> (settings, the synchronous arm it is compared with)
    "sync": ({}, "sync"),
    "async K=5": (ASYNC, "sync"),
    "async K=10": ({**ASYNC, "buffer": 10, "rounds": 8}, "sync"),  # 10 distinct agents a version: slow
    "async K=10 x40": ({**ASYNC, "buffer": 10}, "sync"),  # without the trace: 400 updates, as sync's
    "async K=5 c10": ({**ASYNC, "max_concurrent": 10}, "sync"),  # without the trace: staleness held down
    "async K=5 constant": ({**ASYNC, "staleness": "constant"}, "sync"),
    "async K=5 hinge": ({**ASYNC, "staleness": "hinge:2,1"}, "sync"),
    "sync mnist1d": ({"dataset": "mnist1d"}, "sync mnist1d"),
    "async K=5 mnist1d": ({**ASYNC, "dataset": "mnist1d"}, "sync mnist1d"),
    "sync 100": (BIG, "sync 100"),
    "async K=20 100": ({**BIG, **ASYNC, "buffer": 20}, "sync 100"),
    "sync 100 DP": (PRIVATE, "sync 100 DP"),
    "async K=25 100 DP": ({**PRIVATE, **ASYNC, "buffer": 25, "rounds": 10, "staleness": "constant"}, "sync 100 DP"),
}
HEADER = ("| arm | seeds | final accuracy | reaches sync's final in | x sync's wall time | MB to reach it | "
          "updates folded (late) | lost (late, stale, one per buffer) |")
TAIL = 3  # rounds whose mean accuracy is a run's final accuracy (one round's is noisy under Dirichlet 0.3)


def run_row(trace: str, arm: str, seed: int, out: Path) -> dict:
    settings = SimSettings(**{**COMMON, "seed": seed, "availability": TRACES[trace], **ARMS[arm][0]})
    result = run_sim(settings, out / "last", echo=lambda _line: None)
    name = f"{trace}-{arm}-{seed}".replace(" ", "_").replace("=", "").replace(":", "").replace(",", "")
    shutil.copy(out / "last" / "metrics.jsonl", out / "metrics" / f"{name}.jsonl")
    return {"trace": trace, "arm": arm, "seed": seed, "seconds": round(result.seconds, 1), "metrics": name,
            **describe([json.loads(line) for line in (out / "last" / "metrics.jsonl").read_text().splitlines()])}


def describe(rows: list[dict]) -> dict:
    """A run's rounds as the summary needs them: (seconds into the run, accuracy, cumulative bytes) per round."""
    start = rows[0]["run_started_at"]
    total_bytes, curve = 0, []
    for r in rows:
        total_bytes += r["bytes_up"] + r["bytes_down"]
        curve.append([round(r["finished_at"] - start, 2), r["eval"].get("accuracy"), total_bytes])
    folded = sum(len(r["accepted"]) + len(r["aggregation"].get("folded_late", [])) for r in rows)
    return {"curve": curve, "folded": folded, "late": sum(len(r["aggregation"].get("folded_late", [])) for r in rows),
            "wasted": sum(sum(r.get("wasted", {}).values()) for r in rows),
            "final_accuracy": final_accuracy(curve)}  # fmt: skip


def final_accuracy(curve: list[list]) -> float | None:
    """The mean accuracy of the last ``TAIL`` published models (a rolled-back round has none)."""
    scored = [accuracy for _, accuracy, _ in curve if accuracy is not None]
    return round(statistics.mean(scored[-TAIL:]), 4) if scored else None


def reach(curve: list[list], target: float) -> tuple[float, int] | None:
    """(seconds, bytes) when the curve first reached ``target``; None if it never did."""
    return next(((t, b) for t, accuracy, b in curve if accuracy is not None and accuracy >= target), None)


def summarise(rows: list[dict]) -> str:
    """Per trace and arm, over seeds: final accuracy, time to sync's final accuracy as a multiple of sync's wall
    time, bytes to reach it, updates lost."""
    lines = []
    for trace in TRACES:
        for baseline in dict.fromkeys(base for _, base in ARMS.values()):
            syncs = {r["seed"]: r for r in rows if r["trace"] == trace and r["arm"] == baseline}
            if not syncs:
                continue
            lines += [f"\n{trace}, against {baseline}\n", HEADER, "|---" * (HEADER.count("|") - 1) + "|"]
            for arm in (a for a, (_, base) in ARMS.items() if base == baseline):
                runs = [r for r in rows if r["trace"] == trace and r["arm"] == arm and r["seed"] in syncs]
                if runs:
                    lines.append(arm_line(arm, runs, syncs))
    return "\n".join(lines)


def arm_line(arm: str, runs: list[dict], syncs: dict[int, dict]) -> str:
    times, ratios, mbytes = [], [], []
    for r in runs:
        sync = syncs[r["seed"]]
        hit = reach(r["curve"], sync["final_accuracy"])
        if hit is not None:
            times.append(hit[0])
            ratios.append(hit[0] / sync["curve"][-1][0])
            mbytes.append(hit[1] / 1e6)
    missed = len(runs) - len(times)
    folded, late, lost = (sum(r[k] for r in runs) for k in ("folded", "late", "wasted"))
    seeds, final = ",".join(str(r["seed"]) for r in runs), spread([r["final_accuracy"] * 100 for r in runs])
    share = 100 * lost / max(1, folded + lost)
    return (f"| {arm} | {seeds} | {final} % | {spread(times)} s{f' ({missed} never)' if missed else ''} | "
            f"{spread(ratios, 2)}{each(ratios)} | {spread(mbytes)} | {folded} ({late}) | {lost} ({share:.1f} %) |")


def each(values: list[float]) -> str:
    """`` (0.31, 0.52, 0.40)``: every seed's value, when there are several."""
    return f" ({', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else ""


def spread(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/async"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--summary", action="store_true", help="only print the tables of the runs done")
    args = parser.parse_args()
    (args.out / "metrics").mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(r["trace"], r["arm"], r["seed"]) for r in rows}
    grid = [(t, a, int(s)) for s in args.seeds.split(",") for t in args.traces.split(",") for a in args.arms.split(",")]
    for trace, arm, seed in [] if args.summary else grid:
        if (trace, arm, seed) in done:
            continue
        row = run_row(trace, arm, seed, args.out)
        print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
        with open(log, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        rows.append(row)
    print(summarise(rows))


if __name__ == "__main__":
    main()
