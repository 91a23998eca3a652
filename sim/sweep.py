"""``python -m sim.sweep robustness``: the robustness grid of docs/results/robustness.md, reproducibly.

Runs ``skyfed sim`` (the real daemons over a real broker, one process per node) once per condition x
configuration x seed, appends one JSON line per run to ``<out>/runs.jsonl`` (so an interrupted sweep
resumes where it stopped), keeps each run's ``metrics.jsonl`` in ``<out>/metrics/``, and prints the
markdown table of final accuracies (mean ± sd over seeds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.messages import headline
from sim.federation import SimSettings
from sim.run import exit_on_sigterm, run_sim

if TYPE_CHECKING:
    from models.weights import NamedArrays

CONDITIONS = {  # attack spec per condition ("" = clean); 2 of the 10 agents attack
    "clean": "",
    "sign-flip": "sign-flip",
    "scale x100": "scale:100",
    "noise σ=1": "noise:1",
    "samples 10⁶": "samples:1000000",
}
CONFIGURATIONS = {
    "fedavg, bounds off": ({"name": "fedavg"}, {"clip": "off", "sample_multiple": 0.0}),
    "fedavg, default bounds": ({"name": "fedavg"}, {}),
    "median": ({"name": "median"}, {}),
    "trimmed-mean β=0.2": ({"name": "trimmed-mean", "beta": 0.2}, {}),
    "krum f=2": ({"name": "krum", "f": 2}, {}),  # the default before auto ("krum f=2 (the default)" in the .jsonl)
    "centered-clip": ({"name": "centered-clip"}, {}),
}


def run_grid(out: Path, seeds: list[int], agents: int, attackers: int, rounds: int, scope: str) -> list[dict]:
    log = out / "runs.jsonl"
    (out / "metrics").mkdir(exist_ok=True)
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    finished = {(r["condition"], r["configuration"], r["seed"]) for r in done}
    for condition, attack in CONDITIONS.items():
        for configuration, (strategy, bounds) in CONFIGURATIONS.items():
            for seed in seeds:
                if (condition, configuration, seed) in finished:
                    continue
                settings = SimSettings(
                    agents=agents, rounds=rounds, seed=seed, federation="sweep", strategy=strategy, bounds=bounds,
                    attackers=attackers if attack else 0, attack=attack, attack_scope=scope,
                )  # fmt: skip
                result = run_sim(settings, out / "last", echo=lambda _line: None)
                rows = result.metrics
                name = f"{condition}-{configuration}-{seed}".replace(" ", "_").replace(",", "").replace("=", "")
                shutil.copy(out / "last" / "metrics.jsonl", out / "metrics" / f"{name}.jsonl")
                row = {
                    "condition": condition,
                    "configuration": configuration,
                    "seed": seed,
                    "final_accuracy": final_accuracy(out / "last"),
                    "rolled_back": sum(m.outcome != "committed" for m in rows),
                    "rejected_updates": sum(len(m.rejected) for m in rows),
                    "rounds": len(rows),
                    "seconds": round(result.seconds, 1),
                    "attackers": settings.attacker_names(),
                }
                print(json.dumps(row, ensure_ascii=False), flush=True)
                with open(log, "a") as handle:
                    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
                done.append(row)
    return done


def final_accuracy(run: Path) -> float | None:
    """Accuracy (mAP@.5 for detectors) of the run's final global model on the server's test set (a rolled-back
    round keeps the previous model, so the last metrics line does not always carry it). With partial
    aggregation no global model is anyone's model: the mean over agents of their own models' scores on that
    same set (``personalized_models``), so that it compares with full averaging and centralized training."""
    from broker_server.config import load_server_config
    from broker_server.rounds.evaluation import server_evaluator
    from models.serialization import load_file

    config = load_server_config(run / "federation" / "server" / "server.toml")
    evaluate = server_evaluator(config)
    arrays, _ = load_file(run / "global_model.safetensors")
    if config.server.share != "full":
        models = personalized_models(run / "federation", arrays, config.server.share)
        return statistics.fmean(headline(evaluate(model)) for model in models)
    return headline(evaluate(arrays))


def personalized_models(federation: Path, global_arrays: NamedArrays, share: str) -> list[NamedArrays]:
    """Each agent's own model after a partial-aggregation run: the global model (its shared part is the
    agents' average) with the private part the agent kept on top (none yet: the global model as it is)."""
    from agent.config import load_agent_config
    from models.serialization import load_file
    from participant.detector import private_part_path

    models = []
    for agent_toml in sorted(federation.glob("*/agent.toml")):
        path = private_part_path(load_agent_config(agent_toml).detector_dir, share)
        private = load_file(path)[0] if path.exists() else {}
        models.append({**global_arrays, **private})
    return models


def table(rows: list[dict]) -> str:
    """Markdown: one line per configuration, one column per condition, accuracy in % as mean ± sd."""
    lines = ["| configuration | " + " | ".join(CONDITIONS) + " |", "|---" * (len(CONDITIONS) + 1) + "|"]
    for configuration in CONFIGURATIONS:
        cells = []
        for condition in CONDITIONS:
            accs = [100 * r["final_accuracy"] for r in rows if (r["condition"], r["configuration"]) ==
                    (condition, configuration) and r["final_accuracy"] is not None]  # fmt: skip
            if not accs:
                cells.append("–")
                continue
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            cells.append(f"{statistics.mean(accs):.1f} ± {sd:.1f}")
        lines.append(f"| {configuration} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.sweep", description=__doc__)
    parser.add_argument("grid", choices=["robustness"])
    parser.add_argument("--out", default="runs/robustness")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--attack-scope", default="parameters", choices=["parameters", "all"])
    args = parser.parse_args(argv)
    exit_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_grid(out, args.seeds, args.agents, args.attackers, args.rounds, args.attack_scope)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
