"""``skyfed sim --mode peer``: a broker and N peers (``agent.peer``) as separate processes, no server.

Each peer is ``skyfed agent run`` on its generated agent.toml (attackers and slow peers in
``sim.agent_host``, as in the centralized sim). Each writes its own ``metrics.jsonl`` (one line per round);
this module merges them into ``--out/metrics.jsonl`` (one line per round and peer, ``peer``, ``round``,
``eval``, ``aggregated_from``, …) and writes the model most peers adopted in the BestAgg election as
``global_model.safetensors``.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

from agent.peer.bestagg import BEST_FILE
from agent.peer.rounds import read_metrics
from models.synthetic_detection import NAMES
from protocol.messages import headline
from protocol.scores import personal_score
from sim.federation import SimSettings
from sim.launch import SimResult, fresh_run_folder, late_note, run_broker, spawn_agents, terminate
from sim.peer_federation import create_peer_federation
from sim.report_rows import elected_sha


def run_peer_sim(settings: SimSettings, out: Path, *, broker_address: str | None = None, echo=print) -> SimResult:  # noqa: ANN001
    out, work = fresh_run_folder(out)
    started = time.monotonic()
    with ExitStack() as stack:
        host, port = run_broker(stack, work, broker_address, echo, "; no server: peer mode")
        layout = create_peer_federation(work, settings, (host, port))
        for line in layout.description:
            echo(f"  {line}")
        if attackers := settings.attacker_names():
            echo(f"  attackers ({settings.attack}, {settings.attack_scope}): {', '.join(attackers)}")
        logs = work / "logs"
        logs.mkdir()
        peers = spawn_agents(layout.agent_configs, settings, logs)
        stack.callback(terminate, peers)
        deadline = time.monotonic() + settings.rounds * (settings.deadline_s * 3) + 120
        shown: set[tuple[str, int]] = set()
        while any(p.poll() is None for p in peers) and time.monotonic() < deadline:
            time.sleep(0.5)
            for line in merged_metrics(work, list(layout.agent_configs)):
                if (line["peer"], line["round"]) not in shown:
                    shown.add((line["peer"], line["round"]))
                    echo(format_peer_round(line, time.monotonic() - started))
        if any(p.poll() is None for p in peers):
            raise RuntimeError(f"the peers did not finish within the time allowed (logs in {logs})")
    return collect_peer_results(work, out, list(layout.agent_configs), settings, started)


def merged_metrics(work: Path, names: list[str]) -> list[dict]:
    lines = [line for name in names for line in read_metrics(work / name / "state")]
    return sorted(lines, key=lambda line: (line["round"], line["peer"]))


def format_peer_round(line: dict, elapsed_s: float) -> str:
    score = headline(line["eval"])
    name = "mAP@.5" if "map50" in line["eval"] else "accuracy"
    late = late_note(line.get("aggregation") or {})
    trained = personal_score(line.get("personal") or {}, "trained_c_spe")  # the senders' reports (flcore.personal)
    name += f" {score if score is None else f'{score:.4f}'}"
    name += "" if trained is None else f"  trained C-SPE {trained:.4f}"
    return (f"round {line['round']:3d}  {line['peer']}  {name}"
            f"  from {len(line['aggregated_from'])}{late}  rejected {len(line['rejected'])}"
            f"  round_s {line['round_s']:6.2f}  MB sent {line['bytes_sent'] / 1e6:.3f}"
            f"  elapsed_s {elapsed_s:6.1f}")  # fmt: skip


def collect_peer_results(work: Path, out: Path, names: list[str], settings: SimSettings, started: float) -> SimResult:
    """Merged metrics (with who attacked) and the elected model: the one most peers adopted."""
    extra = {"attackers": settings.attacker_names(), "attack": settings.attack or None, "mode": "peer"}
    lines = [{**line, **extra} for line in merged_metrics(work, names)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    elections = {name: json.loads(p.read_text()) for name in names if (p := work / name / "state" / "election.json")
                 .exists()}  # fmt: skip
    final_eval: dict = {}
    if (sha := elected_sha(elections, extra["attackers"])) is not None:
        holder = next(name for name, e in sorted(elections.items()) if e["sha256"] == sha)
        shutil.copy(work / holder / "state" / BEST_FILE, out / "global_model.safetensors")
        final_eval = shared_test_evaluation(work, settings, out / "global_model.safetensors")
    (out / "election.json").write_text(json.dumps(elections, indent=1))
    return SimResult(out=out, metrics=[], seconds=time.monotonic() - started, final_eval=final_eval, peer_rounds=lines)


def shared_test_evaluation(work: Path, settings: SimSettings, model: Path) -> dict:
    """The elected model on the evaluation set the centralized sim's server uses (``server/test.npz``, detect:
    ``server/eval/data.yaml`` at the run's image size), so the two modes' final scores compare."""
    from models.evaluators import build_evaluator
    from models.serialization import load_file

    detect = settings.task == "detect"
    data = work / "server" / ("eval/data.yaml" if detect else "test.npz")
    num_classes = len(NAMES) if detect else 10
    evaluate = build_evaluator(settings.model, num_classes, data, image_size=settings.image_size,
                               work_dir=work / "server" / "eval-run")  # fmt: skip
    return evaluate(load_file(model)[0])
