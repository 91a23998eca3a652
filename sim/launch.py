"""What every way of running a sim shares (``sim.run``: separate processes; ``sim.inprocess``, ``sim.region_run``,
``sim.peer_run``): its folder and broker, its daemons as child processes, its console line per round, and the
files it leaves in ``--out``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from broker_server.rounds.checkpoint import model_evaluation
from broker_server.watch.monitor_text import number
from common.text import printable
from protocol.buffer_text import buffer_text, wasted_text
from protocol.messages import RoundMetrics
from protocol.mqtt import BrokerSettings
from protocol.scores import headline_text
from sim.broker import start_broker
from sim.federation import SimSettings


@dataclass(frozen=True)
class SimResult:
    out: Path
    metrics: list[RoundMetrics]
    seconds: float
    final_eval: dict  # the evaluation of the global model the run saved (not the last round's: a swap round's
    # is the mean of the agents' models, and an elected best model or a rolled-back round differ too)
    peer_rounds: list[dict] = field(default_factory=list)  # peer mode (no server, so no ``metrics``): each peer's
    # rounds, one dict per round and peer, as --out/metrics.jsonl holds them (sim.peer_run)


SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the folder holding sim/, agent/, skyfed/
MAX_LINE = 2000  # characters of one round's console line


def child_pythonpath(inherited: str, search_path: list[str]) -> str:
    """``PYTHONPATH`` for a daemon started in the user's folder: the modules this process runs must import
    there too. They do when their root is on the search path for a reason other than the folder Python
    was started from (``search_path[0]``: an install, an editable install, ``PYTHONPATH``); else it is added."""
    if str(SOURCE_ROOT) in search_path[1:]:
        return inherited
    return os.pathsep.join(p for p in (str(SOURCE_ROOT), inherited) if p)


def spawn(args: list[str], log_path: Path, module: str = "skyfed") -> subprocess.Popen:
    """``python -m module args`` in the user's current folder (whatever it writes lands where the sim's
    own files do, never in the package's folder); pass it absolute paths."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if pythonpath := child_pythonpath(os.environ.get("PYTHONPATH", ""), sys.path):
        env["PYTHONPATH"] = pythonpath
    with open(log_path, "ab") as log_file:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=log_file, stderr=subprocess.STDOUT, env=env
        )


def terminate(processes: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in processes:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spawn_agents(configs: dict[str, Path], settings: SimSettings, logs: Path) -> list[subprocess.Popen]:
    """One ``skyfed agent run`` per agent, exactly as deployed; attackers and slow agents, or every agent
    with ``agents_per_process`` K > 1, in ``sim.agent_host`` processes of up to K agents (log
    ``<name>.log``, or ``<first>..<last>.log`` for several), which share the cores (``jobs_per_host``)."""
    attackers, slow = settings.attacker_names(), settings.slow_names()
    options = ["--attack", settings.attack, "--scope", settings.attack_scope, "--slowdown", str(settings.slowdown)]
    names, k = list(configs), settings.agents_per_process
    groups = [names[i : i + k] for i in range(0, len(names), k)]
    hosted = [len(g) > 1 or g[0] in attackers or g[0] in slow for g in groups]
    options += ["--jobs-at-once", str(jobs_per_host(sum(hosted)))]
    processes = []
    for group, in_host in zip(groups, hosted, strict=True):
        if not in_host:
            processes.append(spawn(["agent", "run", "--config", str(configs[group[0]])], logs / f"{group[0]}.log"))
            continue
        args = [a for name in group for a in ("--attacker" if name in attackers else "--config", str(configs[name]))]
        args += [a for name in group if name in slow for a in ("--slow", str(configs[name]))]
        log_name = group[0] if len(group) == 1 else f"{group[0]}..{group[-1]}"
        processes.append(spawn([*args, *options], logs / f"{log_name}.log", "sim.agent_host"))
    return processes


def jobs_per_host(hosts: int) -> int:
    """How many jobs each of ``hosts`` host processes runs at once: this machine's cores split among them, at least
    one each. Two hosts of 50 agents each training two at a time ran four trainings on 2 cores; one each, a
    round's overhead at 100 agents fell from 0.34-0.36 to 0.31 s (docs/results/scale.md)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, hosts))


def late_note(aggregation: dict) -> str:
    """`` + N late (agent@round, ...)``: late updates of the round before folded into this one (``flcore.late``)."""
    folded = aggregation.get("folded_late")
    return f" + {len(folded)} late ({','.join(map(str, folded))})" if isinstance(folded, list) and folded else ""


def format_round(m: RoundMetrics, elapsed_s: float) -> str:
    """The console's line for a closed round, led by what the run is judged by (``RoundMetrics.headline``): one
    printable line whatever the public topic carried (a reason may hold an agent's text; anyone on a sim's
    broker can publish there)."""
    if m.outcome != "committed":
        return printable(f"round {m.round:3d}  {m.outcome}: {m.reason}  offenders {','.join(m.offenders) or '-'}",
                         MAX_LINE)  # fmt: skip
    privacy = f"  epsilon {m.privacy.get('epsilon')}" if m.privacy else ""
    privacy += "".join(f"  {text}" for text in (buffer_text(m.buffer), wasted_text(m.wasted)) if text)
    if isinstance(screened := m.aggregation.get("screened"), (dict, list)) and screened:
        privacy += f"  screened {','.join(map(str, screened))}"
    own = 3 if "map50" in m.eval else 2  # a global model's own: accuracy and loss, or mAP@.5, mAP@.5:.95, box loss
    scores = headline_text(m.headline, width=own if m.models == "global" else 4) or "no evaluation"
    late = late_note(m.aggregation)
    if m.action == "local":  # model swapping: agents trained on, nothing was uploaded, so nothing to evaluate
        scores = "local round (trained on, not uploaded)"
    return printable(
        f"round {m.round:3d}  {scores}  participants {len(m.accepted)}/{len(m.participants)}{late}  "
        f"rejected {len(m.rejected)}  round_s {m.duration_s:6.2f}  elapsed_s {elapsed_s:6.1f}  "
        f"MB up {number(m.bytes_up, 1e6, 2)}  MB down {number(m.bytes_down, 1e6, 2)}{privacy}",
        MAX_LINE,
    )


def annotate_metrics(source: Path, target: Path, extra: dict[str, object]) -> None:
    """Copy the server's metrics, adding what only the sim knows (which agents attacked or were slow)."""
    lines = []
    for line in source.read_text().splitlines() if source.exists() else []:  # no round ran: no metrics
        if line.strip():
            lines.append(json.dumps({**json.loads(line), **extra}, separators=(",", ":")))
    target.write_text("".join(line + "\n" for line in lines))


def run_broker(stack: ExitStack, work: Path, broker_address: str | None, echo, note: str = "") -> tuple[str, int]:  # noqa: ANN001
    """The run's broker: ``broker_address`` when given, else one started for this run (stopped by ``stack``)."""
    if broker_address is not None:
        given = BrokerSettings.from_address(broker_address)
        echo(f"broker: {broker_address} (given){note}")
        return given.host, given.port
    broker = stack.enter_context(start_broker(data_dir=work / "broker"))
    echo(f"broker: {broker.kind} on {broker.address} (started for this run){note}")
    return broker.host, broker.port


def fresh_run_folder(out: Path) -> tuple[Path, Path]:
    """``out`` as an absolute path (the daemons get absolute paths: relative ones would name other files from
    their folder) and its empty ``federation`` folder, for the keys, configs, data, state and logs of every node."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "federation"
    shutil.rmtree(work, ignore_errors=True)
    return out, work


def logged_rounds(path: Path) -> list[RoundMetrics]:
    """Every finished round, from the server's own ``metrics.jsonl`` (none: no round ran; no size limit)."""
    lines = path.read_bytes().splitlines() if path.exists() else []
    return [RoundMetrics.from_dict(json.loads(line)) for line in lines if line.strip()]


def collect_results(state: Path, out: Path, extra: dict, metrics: list[RoundMetrics], started: float) -> SimResult:
    """A finished run's files in ``out``: metrics (with ``extra``), the final model (safetensors, and ONNX when
    its export passed), the curves."""
    annotate_metrics(state / "metrics.jsonl", out / "metrics.jsonl", extra)
    for name in ("global_model.safetensors", "global_model.onnx"):
        if (state / name).exists():
            shutil.copy(state / name, out / name)
    if metrics:
        from sim.plots import plot_curves  # matplotlib: a second's import, paid once the run is over

        plot_curves(out / "metrics.jsonl", out / "curves.png")
    final_eval = model_evaluation(state / "checkpoint")
    return SimResult(out=out, metrics=metrics, seconds=time.monotonic() - started, final_eval=final_eval)
