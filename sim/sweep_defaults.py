"""``python -m sim.sweep_defaults``: the grid that chose the default aggregation (docs/results/robustness.md).

Runs ``skyfed sim`` once per data split x condition x strategy x seed and appends one JSON line per run to
``<out>/runs.jsonl``; an interrupted sweep resumes where it stopped. The order makes a partial sweep usable:
every strategy's clean runs on every split first (they decide "loses at most 1 point against FedAvg with no
attacker"), then sign flips (the attack that bounds alone do not stop), then the other attacks. A strategy
whose clean mean on a split is more than ``--drop-below`` points under FedAvg's there is not run under attack
on that split (it has failed the clean criterion already); the table says "dropped".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from sim.federation import SimSettings
from sim.run import exit_on_sigterm, run_sim
from sim.sweep import final_accuracy

PARTITIONS = ("iid", "dirichlet:0.5", "dirichlet:0.1", "shards")  # shards: 2 label-sorted shards = 2 labels each
# "attackers left out": the 2 attackers never deliver (``--attack silent``), so every strategy averages the
# 8 honest agents alone: the most any defence can keep when it discards the attackers and their data with them
CONDITIONS = {"clean": "", "sign-flip": "sign-flip", "scale x100": "scale:100", "noise σ=1": "noise:1",
              "samples 10⁶": "samples:1000000", "attackers left out": "silent"}  # fmt: skip
STRATEGIES = {
    "fedavg": {"name": "fedavg"},
    "krum f=2": {"name": "krum", "f": 2},
    "trimmed-mean β=0.2": {"name": "trimmed-mean", "beta": 0.2},
    "median": {"name": "median"},
    "centered-clip": {"name": "centered-clip"},
    "centered-clip τ=0.5": {"name": "centered-clip", "tau_multiple": 0.5},
    "centered-clip τ=0.25": {"name": "centered-clip", "tau_multiple": 0.25},
    "centered-clip s=2": {"name": "centered-clip", "bucket": 2},
    "auto": {"name": "auto"},  # the default since the sweep: Krum or centered-clip by measured agreement
}
BASELINE = "fedavg"


def cells(partitions: list[str], conditions: list[str], strategies: list[str], seeds: list[int]) -> list[tuple]:
    """(partition, condition, strategy, seed) in the order the sweep runs them."""
    return [(p, c, s, seed) for c in conditions for p in partitions for s in strategies for seed in seeds]


def clean_mean(rows: list[dict], partition: str, strategy: str) -> float | None:
    accs = accuracies(rows, partition, "clean", strategy)
    return statistics.fmean(accs) if accs else None


def dropped(rows: list[dict], partition: str, strategy: str, drop_below: float) -> bool:
    """Whether ``strategy`` already failed the clean criterion on ``partition`` by more than ``drop_below``."""
    own, base = clean_mean(rows, partition, strategy), clean_mean(rows, partition, BASELINE)
    return strategy != BASELINE and own is not None and base is not None and base - own > drop_below


def run_grid(out: Path, args: argparse.Namespace) -> list[dict]:
    log = out / "runs.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(r["partition"], r["condition"], r["strategy"], r["seed"]) for r in rows}
    for partition, condition, strategy, seed in cells(args.partitions, args.conditions, args.strategies, args.seeds):
        if (partition, condition, strategy, seed) in done:
            continue
        if condition != "clean" and dropped(rows, partition, strategy, args.drop_below):
            continue
        attack = CONDITIONS[condition]
        settings = SimSettings(
            agents=args.agents, rounds=args.rounds, seed=seed, federation="defaults", partition=partition,
            strategy=STRATEGIES[strategy], attackers=args.attackers if attack else 0, attack=attack,
            in_process=args.in_process,
        )  # fmt: skip
        result = run_sim(settings, out / "last", echo=lambda _line: None)
        row = {
            "partition": partition, "condition": condition, "strategy": strategy, "seed": seed,
            "final_accuracy": final_accuracy(out / "last"), "agents": args.agents, "rounds": len(result.metrics),
            "rolled_back": sum(m.outcome != "committed" for m in result.metrics),
            "seconds": round(result.seconds, 1), "attackers": settings.attacker_names(),
            "in_process": args.in_process, **adaptive_choice(result.metrics),
        }  # fmt: skip
        print(json.dumps(row, ensure_ascii=False), flush=True)
        with open(log, "a") as handle:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        rows.append(row)
    return rows


def adaptive_choice(metrics: list) -> dict:
    """For the adaptive default (``strategies.auto``): which aggregations its rounds ran and the agreement."""
    chose = sorted({m.aggregation["chose"] for m in metrics if "chose" in m.aggregation})
    agreed = [m.aggregation["agreement"] for m in metrics if m.aggregation.get("agreement") is not None]
    return {"chose": chose, "agreement": agreed[-1] if agreed else None} if chose else {}


def accuracies(rows: list[dict], partition: str, condition: str, strategy: str) -> list[float]:
    return [100 * r["final_accuracy"] for r in rows if (r["partition"], r["condition"], r["strategy"]) ==
            (partition, condition, strategy) and r["final_accuracy"] is not None]  # fmt: skip


def cell(accs: list[float], own_clean: float | None, base_clean: float | None) -> str:
    """``mean ± sd (Δ FedAvg clean / Δ own clean)``, in points."""
    mean = statistics.fmean(accs)
    sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
    deltas = [f"{mean - ref:+.1f}" if ref is not None else "?" for ref in (base_clean, own_clean)]
    note = "" if len(accs) == 3 else f", {len(accs)} seed{'s' if len(accs) > 1 else ''}"
    return f"{mean:.1f} ± {sd:.1f} ({' / '.join(deltas)}{note})"


def table(rows: list[dict], partitions: list[str], strategies: list[str], drop_below: float) -> str:
    """Markdown: a line per split x strategy, a column per condition; each cell is the final accuracy in %
    (mean ± sd over seeds) and, in brackets, the points against FedAvg's clean run and against its own."""
    lines = ["| split | strategy | " + " | ".join(CONDITIONS) + " |", "|---" * (len(CONDITIONS) + 2) + "|"]
    for partition in partitions:
        base = clean_mean(rows, partition, BASELINE)
        for strategy in strategies:
            own = clean_mean(rows, partition, strategy)
            out = []
            for condition in CONDITIONS:
                accs = accuracies(rows, partition, condition, strategy)
                if accs:
                    out.append(cell(accs, own, base))
                elif condition != "clean" and dropped(rows, partition, strategy, drop_below):
                    out.append("dropped")
                else:
                    out.append("not run")
            lines.append(f"| {partition} | {strategy} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.sweep_defaults", description=__doc__)
    parser.add_argument("--out", default="runs/defaults")
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=list(CONDITIONS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--drop-below",
        type=float,
        default=5.0,
        metavar="POINTS",  # "clearly fails" the clean rule
        help="skip a strategy's attacked runs where its clean mean is this far below FedAvg's",
    )
    parser.add_argument("--in-process", action="store_true", help="no broker and daemons (sim.inprocess)")
    parser.add_argument("--table-only", action="store_true", help="print the table of what is in runs.jsonl")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        log = out / "runs.jsonl"
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    else:
        rows = run_grid(out, args)
    print(table(rows, args.partitions, args.strategies, args.drop_below))
    return 0


if __name__ == "__main__":
    sys.exit(main())
