"""``skyfed sim --config experiments/<name>.toml``: a grid of whole federations, and its results table.

An experiment file names ``seeds``, a ``target`` accuracy, the ``[sim]`` settings every run shares
(any ``sim.federation.SimSettings`` field), ``[conditions]`` (e.g. data partitions) and ``[methods]``
(e.g. strategies), each a table of SimSettings overrides. Every condition × method × seed is one real
``skyfed sim`` run (real daemons, real broker). One JSON line per run goes to ``<out>/runs.jsonl``
(an interrupted experiment resumes where it stopped), each run's ``metrics.jsonl`` to
``<out>/metrics/``; ``<out>/results.md`` gets the table and ``<out>/curves-<condition>.png`` the mean
accuracy per round.

Measured per run: the final accuracy of the published global model; rounds and seconds until a
*published* model (not a swapping strategy's local or swap round) first reached ``target``; bytes per
round, up and down; the server's aggregation time per round. Where rounds carry ``personal`` metrics:
the last row's mean C-SPE and C-GEN of the models agents started from and of the models they trained
(``trained``, the seeds' metric), the rounds of training until each mean C-GEN first reached ``personal_target``
(default ``target``), and which score each run leads with (its last headline's first: C-SPE for a method that
keeps its agents' own models). A row's start scores describe what the previous round produced, so they count
as r − 1 rounds of training (FedAvg's count equals its global model's); its trained scores count as r.
"""

from __future__ import annotations

import itertools
import json
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import toml
from protocol.messages import headline
from protocol.scores import LABELS, row_headline
from protocol.typed import SchemaError, build
from sim.federation import SimSettings
from sim.run import run_sim
from sim.sweep import final_accuracy

# a run's lead score (``summarise``'s ``lead``) → the row field that holds its final value
FINAL = {"c_spe": "final_c_spe", "c_gen": "final_c_gen", "accuracy": "final_accuracy", "map50": "final_accuracy"}


@dataclass(frozen=True)
class Experiment:
    title: str
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    target: float = 0.9
    personal_target: float | None = None  # C-GEN's target (default: target)
    sim: dict = field(default_factory=dict)
    conditions: dict = field(default_factory=lambda: {"default": {}})
    methods: dict = field(default_factory=lambda: {"default": {}})

    @property
    def c_gen_target(self) -> float:
        return self.target if self.personal_target is None else self.personal_target

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


def summarise(metrics: list[dict], target: float, personal_target: float | None = None) -> dict[str, Any]:
    """Rounds and seconds to ``target`` (published models only), bytes and aggregation time per round, and
    the personal metrics (C-SPE, C-GEN; ``None`` where rounds carry none)."""
    published = _published(metrics)
    reached = next((m for m in published if (headline(m["eval"]) or 0.0) >= target), None)
    start = metrics[0]["finished_at"] - metrics[0]["duration_s"]
    return {
        "rounds_to_target": reached["round"] if reached else None,
        "seconds_to_target": round(reached["finished_at"] - start, 1) if reached else None,
        "bytes_up_per_round": round(statistics.mean(m["bytes_up"] for m in metrics)),
        "bytes_down_per_round": round(statistics.mean(m["bytes_down"] for m in metrics)),
        "aggregate_ms_per_round": round(statistics.mean(m.get("aggregate_s", 0.0) for m in metrics) * 1e3, 3),
        "accuracy_by_round": [headline(m["eval"]) for m in metrics],
        "epsilon": _epsilon(metrics),
        "lead": next((h[0]["key"] for m in reversed(metrics) if (h := row_headline(m))), None),
        **_personal(metrics, target if personal_target is None else personal_target),
    }


def _published(metrics: list[dict]) -> list[dict]:
    """The rounds whose model was published: ``average`` rounds, and any round that moved the model version
    on (DemLearn's and FedAMP's rounds publish the mean under their own action names; a swap round does not)."""
    published, version = [], 1  # a simulation's server starts at version 1
    for m in metrics:
        moved = m.get("model_version", version) > version
        if m["outcome"] == "committed" and (m.get("action", "average") == "average" or moved):
            published.append(m)
        version = max(version, m.get("model_version", version))
    return published


def _personal(metrics: list[dict], target: float) -> dict[str, Any]:
    """Final mean C-SPE and C-GEN, rounds of training until C-GEN reached ``target``, and both per round, of the
    start models (row r → r − 1 rounds) and of the trained ones (``trained_…``; row r → r rounds)."""
    out: dict[str, Any] = {}
    for prefix, scores, done in (("", lambda m: m.get("personal", {}), 1), ("trained_", _trained, 0)):
        c_spe, c_gen = ([scores(m).get(key) for m in metrics] for key in ("c_spe", "c_gen"))
        reached = next((m["round"] - done for m, gen in zip(metrics, c_gen, strict=True) if (gen or 0.0) >= target),
                       None)  # fmt: skip
        out.update({f"final_{prefix}c_spe": c_spe[-1], f"final_{prefix}c_gen": c_gen[-1],
                    f"rounds_to_{prefix}c_gen": reached, f"{prefix}c_spe_by_round": c_spe,
                    f"{prefix}c_gen_by_round": c_gen})  # fmt: skip
    return out


def _trained(row: dict) -> dict:
    trained = row.get("personal", {}).get("trained")
    return trained if isinstance(trained, dict) else {}


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
    grid = list(itertools.product(experiment.conditions, experiment.methods, experiment.seeds))
    todo = [run for run in grid if run not in finished]
    spent: list[float] = []  # seconds of each run done in this invocation: the ETA's pace
    for condition, method, seed in todo:
        done = len(grid) - len(todo) + len(spent)
        echo(grid_progress(done, len(grid), spent, f"{condition} / {method} / seed {seed}"))
        result = run_sim(experiment.settings(condition, method, seed), out / "last", echo=lambda _line: None)
        spent.append(result.seconds)
        shutil.copy(out / "last" / "metrics.jsonl", _metrics_path(out, condition, method, seed))
        metrics = [json.loads(m.to_json()) for m in result.metrics]
        row = {"condition": condition, "method": method, "seed": seed,
               "final_accuracy": final_accuracy(out / "last"), "rounds": len(metrics),
               "seconds": round(result.seconds, 1), **summarise(metrics, experiment.target,
                                                                  experiment.c_gen_target)}  # fmt: skip
        echo(json.dumps({k: v for k, v in row.items() if not k.endswith("_by_round")}))
        with open(log, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        rows.append(row)
    rows = [_resummarised(row, out, experiment) for row in rows]
    (out / "results.md").write_text(table(experiment, rows) + "\n")
    plot(experiment, rows, out)
    return rows


def grid_progress(done: int, total: int, spent: list[float], what: str) -> str:
    """``[3/12] iid / fedavg / seed 2: ETA 4 min 10 s`` (the mean of the runs done in this invocation, times
    the runs left including this one; unknown before the first has finished)."""
    left = total - done
    if not spent:
        eta = "ETA after the first run"
    else:
        seconds = round(statistics.mean(spent) * left)
        eta = f"ETA {seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"ETA {seconds} s"
    return f"[{done + 1}/{total}] {what}: {eta}"


def _metrics_path(out: Path, condition: str, method: str, seed: int) -> Path:
    return out / "metrics" / (f"{condition}-{method}-{seed}".replace(" ", "_").replace("/", "_") + ".jsonl")


def _resummarised(row: dict, out: Path, experiment: Experiment) -> dict:
    """``row`` with its summary recomputed from the run's stored metrics, so a changed ``target`` (or a
    measure added since) applies to runs already done."""
    path = _metrics_path(out, row["condition"], row["method"], row["seed"])
    if not path.exists():
        return row
    metrics = [json.loads(line) for line in path.read_text().splitlines() if line]
    return {**row, **summarise(metrics, experiment.target, experiment.c_gen_target)}


def _mean_sd(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values) * scale:.{digits}f} ± {sd * scale:.{digits}f}"


def table(experiment: Experiment, rows: list[dict]) -> str:
    """Markdown, one line per condition and method: mean ± sd over seeds. Where agents report C-SPE and C-GEN,
    each line leads with its method's own score, named (C-SPE for a method that keeps a model per group or
    agent, the global model's otherwise: docs/architecture.md, "One headline per shape and kind of model"),
    then the personal scores, then the global model's."""
    target = f"{experiment.target:.0%}"
    personal = any(r.get("final_c_gen") is not None or r.get("final_c_spe") is not None for r in rows)
    gen_target = f"{experiment.c_gen_target:.0%}"
    own = "".join(f" final {t}C-SPE % | final {t}C-GEN % | rounds to {t}C-GEN {gen_target} |" for t in ("", "trained "))
    own = f" lead: the method's own score % |{own}" if personal else ""
    shared = f"global {experiment.score}" if personal else experiment.score
    lines = [
        f"| condition | method |{own} final {shared} % | rounds to {target} | seconds to {target} | kB up / round "
        "| kB down / round | epsilon |",
        "|---|---|---|---|---|---|---|---|" + "---|" * (7 if personal else 0),
    ]
    for condition in experiment.conditions:
        for method in experiment.methods:
            runs = [r for r in rows if (r["condition"], r["method"]) == (condition, method)]
            if not runs:
                continue
            rounds, seconds = (_reached(runs, key) for key in ("rounds_to_target", "seconds_to_target"))
            if personal:
                own = f" {_lead(runs)} |"
                for prefix in ("", "trained_"):
                    spe, gen = ([r[key] for r in runs if r.get(key) is not None]
                                for key in (f"final_{prefix}c_spe", f"final_{prefix}c_gen"))  # fmt: skip
                    reached = _reached(runs, f"rounds_to_{prefix}c_gen")
                    own += f" {_mean_sd(spe, 100)} | {_mean_sd(gen, 100)} | {reached} |"
            lines.append(
                f"| {condition} | {method} |{own} {_mean_sd([r['final_accuracy'] for r in runs], 100)} | {rounds} | "
                f"{seconds} | {_mean_sd([r['bytes_up_per_round'] for r in runs], 1e-3, 0)} | "
                f"{_mean_sd([r['bytes_down_per_round'] for r in runs], 1e-3, 0)} | "
                f"{_mean_sd([r['epsilon'] for r in runs if r.get('epsilon') is not None], digits=2)} |"
            )
    return "\n".join(lines)


def _lead(runs: list[dict]) -> str:
    """The score the method is judged by (its runs' headline lead, ``summarise``'s ``lead``), named, as mean ±
    sd over seeds: C-SPE or C-GEN as the runs' last rows give them, the global model's as published."""
    leads = [r.get("lead") for r in runs]
    key = max(leads, key=leads.count)
    if key not in FINAL:
        return "–"
    return f"{LABELS[key]} {_mean_sd([r[FINAL[key]] for r in runs if r.get(FINAL[key]) is not None], 100)}"


def _reached(runs: list[dict], key: str) -> str:
    """Mean ± sd of ``key`` over the seeds that reached the target, how many did, or "never"."""
    reached = [r[key] for r in runs if r.get(key) is not None]
    if not reached:
        return "never"
    return _mean_sd(reached) + (f" ({len(reached)}/{len(runs)} seeds)" if len(reached) < len(runs) else "")


def plot(experiment: Experiment, rows: list[dict], out: Path) -> None:
    """``curves-<condition>.png``: accuracy per round, mean over seeds, one line per method; before it mean
    C-SPE and C-GEN per round where the runs have them (plotted at the round that produced the models)."""
    from sim.plots import plt

    panels = [("accuracy_by_round", f"global model {experiment.score}", 1, experiment.target)]
    if any(r.get("final_c_gen") is not None or r.get("final_c_spe") is not None for r in rows):
        panels = [("c_spe_by_round", "C-SPE (start model, own test split)", 0, None),
                  ("c_gen_by_round", "C-GEN (start model, evaluation set)", 0, experiment.c_gen_target),
                  ("trained_c_spe_by_round", "trained C-SPE (own test split)", 1, None),
                  ("trained_c_gen_by_round", "trained C-GEN (evaluation set)", 1, experiment.c_gen_target),
                  *panels]  # fmt: skip
    for condition in experiment.conditions:
        columns = min(3, len(panels))
        lines_of = -(-len(panels) // columns)
        fig, axes = plt.subplots(lines_of, columns, figsize=(6 * columns, 4 * lines_of), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (key, name, first, line) in zip(axes.flat, panels, strict=False):
            for index, method in enumerate(experiment.methods):  # a method keeps its colour in every panel
                curves = [r[key] for r in rows if (r["condition"], r["method"]) == (condition, method) and key in r]
                if not any(v is not None for c in curves for v in c):  # not measured (Ditto's C-GEN): no line at 0
                    continue
                length = min(map(len, curves))
                mean = [statistics.mean(c[i] or 0.0 for c in curves) for i in range(length)]
                ax.plot(range(first, first + length), mean, label=method, color=f"C{index % 10}")
            if line is not None:
                ax.axhline(line, color="grey", linestyle=":", linewidth=1)
            ax.set(xlabel="round", ylabel="mean over seeds", title=name)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{experiment.title}: {condition}")
        fig.tight_layout()
        fig.savefig(out / f"curves-{condition.replace(' ', '_').replace('/', '_')}.png", dpi=100)
        plt.close(fig)
