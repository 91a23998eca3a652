"""``skyfed sim --config experiments/<name>.toml``: a grid of whole federations, and its results table.

An experiment file names ``seeds``, a ``target`` accuracy, the ``[sim]`` settings every run shares
(any ``sim.federation.SimSettings`` field), ``[conditions]`` (e.g. data partitions) and ``[methods]``
(e.g. strategies), each a table of SimSettings overrides. Every condition × method × seed is one real
``skyfed sim`` run (real daemons, real broker). One JSON line per run goes to ``<out>/runs.jsonl``
(an interrupted experiment resumes where it stopped), each run's ``metrics.jsonl`` to
``<out>/metrics/``; ``<out>/results.md`` gets the table and ``<out>/curves-<condition>.png`` the mean
accuracy per round.

Measured per run: the final accuracy of the published global model; rounds and seconds until a
*published* model (an ``average`` round, for swapping strategies) first reached ``target``; bytes per
round, up and down.
"""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import toml
from protocol.messages import headline
from protocol.typed import SchemaError, build
from sim.federation import SimSettings
from sim.run import run_sim
from sim.sweep import final_accuracy


@dataclass(frozen=True)
class Experiment:
    title: str
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    target: float = 0.9
    sim: dict = field(default_factory=dict)
    conditions: dict = field(default_factory=lambda: {"default": {}})
    methods: dict = field(default_factory=lambda: {"default": {}})

    @property
    def score(self) -> str:
        """What the table's score is: test accuracy, or mAP@.5 for detection experiments."""
        return "mAP@.5" if self.sim.get("task") == "detect" else "accuracy"

    def settings(self, condition: str, method: str, seed: int) -> SimSettings:
        merged: dict[str, Any] = {**self.sim, **self.conditions[condition], **self.methods[method], "seed": seed}
        return build(SimSettings, merged, where=f"methods.{method}", strict=True)


def load_experiment(path: Path) -> Experiment:
    """Read and check an experiment file; every run's settings are built once, so a bad key fails now."""
    try:
        experiment = build(Experiment, toml.loads(path.read_text()), where=path.name, strict=True)
        tables = {"sim": {}}  # each table over [sim] first, so an error names the table it is in
        tables |= {f"conditions.{name}": t for name, t in experiment.conditions.items()}
        tables |= {f"methods.{name}": t for name, t in experiment.methods.items()}
        for where, table in tables.items():
            build(SimSettings, {**experiment.sim, **table}, where=where, strict=True)
        for condition in experiment.conditions:
            for method in experiment.methods:
                experiment.settings(condition, method, experiment.seeds[0])
    except (SchemaError, toml.TOMLDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return experiment


def summarise(metrics: list[dict], target: float) -> dict[str, Any]:
    """Rounds and seconds to ``target`` (published models only), and bytes per round."""
    published = [m for m in metrics if m.get("action", "average") == "average" and m["outcome"] == "committed"]
    reached = next((m for m in published if (headline(m["eval"]) or 0.0) >= target), None)
    start = metrics[0]["finished_at"] - metrics[0]["duration_s"]
    return {
        "rounds_to_target": reached["round"] if reached else None,
        "seconds_to_target": round(reached["finished_at"] - start, 1) if reached else None,
        "bytes_up_per_round": round(statistics.mean(m["bytes_up"] for m in metrics)),
        "bytes_down_per_round": round(statistics.mean(m["bytes_down"] for m in metrics)),
        "accuracy_by_round": [headline(m["eval"]) for m in metrics],
        "epsilon": _epsilon(metrics),
    }


def _epsilon(metrics: list[dict]) -> float | None:
    """The run's epsilon: central DP's (the worst agent's, after the last round) or, with local DP-SGD, the
    largest any agent reported; None without DP (and for central DP over unprotected models)."""
    central = metrics[-1].get("privacy", {}).get("epsilon")
    local = [e for m in metrics for e in m.get("aggregation", {}).get("local_epsilon", {}).values()]
    return central if central is not None else max(local, default=None)


def run_experiment(experiment: Experiment, out: Path, echo=print) -> list[dict]:  # noqa: ANN001
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics").mkdir(exist_ok=True)
    log = out / "runs.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    finished = {(r["condition"], r["method"], r["seed"]) for r in rows}
    for condition in experiment.conditions:
        for method in experiment.methods:
            for seed in experiment.seeds:
                if (condition, method, seed) in finished:
                    continue
                result = run_sim(experiment.settings(condition, method, seed), out / "last", echo=lambda _line: None)
                shutil.copy(out / "last" / "metrics.jsonl", _metrics_path(out, condition, method, seed))
                metrics = [json.loads(m.to_json()) for m in result.metrics]
                row = {"condition": condition, "method": method, "seed": seed,
                       "final_accuracy": final_accuracy(out / "last"), "rounds": len(metrics),
                       "seconds": round(result.seconds, 1), **summarise(metrics, experiment.target)}  # fmt: skip
                echo(json.dumps({k: v for k, v in row.items() if k != "accuracy_by_round"}))
                with open(log, "a") as handle:
                    handle.write(json.dumps(row) + "\n")
                rows.append(row)
    rows = [_resummarised(row, out, experiment.target) for row in rows]
    (out / "results.md").write_text(table(experiment, rows) + "\n")
    plot(experiment, rows, out)
    return rows


def _metrics_path(out: Path, condition: str, method: str, seed: int) -> Path:
    return out / "metrics" / (f"{condition}-{method}-{seed}".replace(" ", "_").replace("/", "_") + ".jsonl")


def _resummarised(row: dict, out: Path, target: float) -> dict:
    """``row`` with its summary recomputed from the run's stored metrics, so a changed ``target`` applies
    to runs already done."""
    path = _metrics_path(out, row["condition"], row["method"], row["seed"])
    if not path.exists():
        return row
    return {**row, **summarise([json.loads(line) for line in path.read_text().splitlines() if line], target)}


def _mean_sd(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values) * scale:.{digits}f} ± {sd * scale:.{digits}f}"


def table(experiment: Experiment, rows: list[dict]) -> str:
    """Markdown, one line per condition and method: mean ± sd over seeds."""
    target = f"{experiment.target:.0%}"
    lines = [
        f"| condition | method | final {experiment.score} % | rounds to {target} | seconds to {target} | kB up / round "
        "| kB down / round | epsilon |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for condition in experiment.conditions:
        for method in experiment.methods:
            runs = [r for r in rows if (r["condition"], r["method"]) == (condition, method)]
            if not runs:
                continue
            reached = [r for r in runs if r["rounds_to_target"] is not None]
            rounds = _mean_sd([r["rounds_to_target"] for r in reached]) if reached else "never"
            seconds = _mean_sd([r["seconds_to_target"] for r in reached]) if reached else "never"
            if reached and len(reached) < len(runs):
                share = f" ({len(reached)}/{len(runs)} seeds)"
                rounds, seconds = rounds + share, seconds + share
            lines.append(
                f"| {condition} | {method} | {_mean_sd([r['final_accuracy'] for r in runs], 100)} | {rounds} | "
                f"{seconds} | {_mean_sd([r['bytes_up_per_round'] for r in runs], 1e-3, 0)} | "
                f"{_mean_sd([r['bytes_down_per_round'] for r in runs], 1e-3, 0)} | "
                f"{_mean_sd([r['epsilon'] for r in runs if r.get('epsilon') is not None], digits=2)} |"
            )
    return "\n".join(lines)


def plot(experiment: Experiment, rows: list[dict], out: Path) -> None:
    """``curves-<condition>.png``: accuracy per round, mean over seeds, one line per method."""
    from sim.plots import plt

    for condition in experiment.conditions:
        fig, ax = plt.subplots(figsize=(7, 4))
        for method in experiment.methods:
            curves = [r["accuracy_by_round"] for r in rows if (r["condition"], r["method"]) == (condition, method)]
            if not curves:
                continue
            length = min(map(len, curves))
            mean = [statistics.mean(c[i] or 0.0 for c in curves) for i in range(length)]
            ax.plot(range(1, length + 1), mean, label=method)
        ax.axhline(experiment.target, color="grey", linestyle=":", linewidth=1)
        ax.set(xlabel="round", ylabel=f"{experiment.score} (mean over seeds)", title=f"{experiment.title}: {condition}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"curves-{condition.replace(' ', '_').replace('/', '_')}.png", dpi=100)
        plt.close(fig)
