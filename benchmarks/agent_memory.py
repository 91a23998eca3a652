"""``python -m benchmarks.agent_memory``: the agent daemon's memory idle and per round, and round times, for
each ``training.worker`` (per-round, warm, adaptive).

A real federation of two agents (``skyfed agent run``, the digits CNN, 8 rounds back to back) and a server
over a mosquitto this benchmark starts. For each worker: agent-01's daemon resident memory (VmRSS) once
connected with no server (idle), the peak of daemon + training child while rounds run (sampled every
0.1 s), the memory after the rounds (adaptive: after its ``warm_idle_s``, set to 10 s here; the deployed
default is 120 s), and the round times from the server's ``metrics.jsonl`` (the first round pays the child's
start-up; per-round children pay it every round). Baselines in the same run: the warm child's median round
time (the target: adaptive within 1.2x of it while rounds keep coming) and a process importing what the
daemon imported before its training moved to a child (the target: idle <= 80 MB).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import report
from benchmarks.many_agents import _descendants
from common import toml
from protocol.config import write_toml
from sim.broker import start_broker
from sim.federation import SimSettings, create_federation
from sim.run import spawn

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20
ROUNDS = 8
AGENTS = 2
WORKERS = ("per-round", "warm", "adaptive")
WARM_IDLE_S = 10.0  # adaptive: the idle time after which the child goes (shortened from 120 s to keep make bench short)


def rss(pid: int) -> int:
    """Resident memory of ``pid`` in bytes (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)


def wait_for_line(log: Path, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text() if log.exists() else ""):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{log}: no {text!r} after {timeout_s:.0f} s")
        time.sleep(0.1)


def baseline_idle_rss() -> int:
    """What the daemon held when it imported PyTorch and built its trainer itself (before training moved to a
    child process)."""
    code = "import agent.daemon, participant.classifier, models.zoo, torch; torch.zeros(1); import time; time.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        time.sleep(8.0)
        return rss(process.pid)
    finally:
        process.kill()
        process.wait()


def memory_of(pid: int) -> int:
    """A daemon and its training child, together."""
    return rss(pid) + sum(rss(child) for child in _descendants(pid))


def measure(worker: str, work: Path) -> dict:
    broker = start_broker(data_dir=work / "broker")
    agents = []
    try:
        settings = SimSettings(agents=AGENTS, rounds=ROUNDS, worker=worker, deadline_s=300.0,
                               strategy={"name": "fedavg"})  # fmt: skip
        layout = create_federation(work / "fed", settings, (broker.host, broker.port))
        for name, config in layout.agent_configs.items():
            if worker == "adaptive":
                data = toml.loads(config.read_text())
                data["training"]["warm_idle_s"] = WARM_IDLE_S
                write_toml(config, data)
            agents.append(spawn(["agent", "run", "--config", str(config)], work / f"{name}.log"))
        wait_for_line(work / "agent-01.log", "mqtt connected")
        time.sleep(3.0)
        agent, idle = agents[0], rss(agents[0].pid)
        server = spawn(["server", "run", "--config", str(layout.server_config)], work / "server.log")
        peak = daemon_peak = 0
        while server.poll() is None:
            daemon_peak = max(daemon_peak, rss(agent.pid))
            peak = max(peak, memory_of(agent.pid))
            time.sleep(0.1)
        time.sleep(3.0 + (WARM_IDLE_S if worker == "adaptive" else 0.0))
        after = memory_of(agent.pid)
        metrics = [json.loads(line) for line in (layout.server_config.parent / "state" / "metrics.jsonl").open()]
    finally:
        for process in agents:
            process.terminate()
            process.wait(30)
        broker.stop()
    rounds = [m["duration_s"] for m in metrics]
    return {"idle_mb": idle / MB, "daemon_peak_mb": daemon_peak / MB, "peak_with_child_mb": peak / MB,
            "idle_after_rounds_mb": after / MB, "first_round_s": rounds[0], "median_round_s": statistics.median(rounds),
            "later_round_s": statistics.median(rounds[1:]), "rounds": len(rounds)}  # fmt: skip


def main() -> None:
    baseline = baseline_idle_rss()
    with tempfile.TemporaryDirectory(prefix="skyfed-agent-memory-") as tmp:
        results = {worker: measure(worker, Path(tmp) / worker) for worker in WORKERS}
    adaptive, warm = results["adaptive"], results["warm"]
    report("agent_idle_rss", target="idle daemon <= 80 MB (a Jetson-class device's share for SkyFed)",
           ok=adaptive["idle_mb"] <= 80,
           idle_mb=round(adaptive["idle_mb"], 1), baseline_torch_in_daemon_mb=round(baseline / MB, 1),
           ratio=round(baseline / MB / adaptive["idle_mb"], 2))  # fmt: skip
    for worker, figures in results.items():
        report(f"agent_rounds_{worker}", target="measured: which worker fits which device (README)", ok=True,
               **{key: round(value, 2) for key, value in figures.items()})  # fmt: skip
    ratio = adaptive["median_round_s"] / warm["median_round_s"]
    report("agent_adaptive_worker", target="median round <= 1.2x the warm child's, idle after warm_idle_s <= 80 MB "
           "(the adaptive worker's promise: warm speed, idle memory)",
           ok=ratio <= 1.2 and adaptive["idle_after_rounds_mb"] <= 80,
           median_round_vs_warm=round(ratio, 2),
           per_round_vs_warm=round(results["per-round"]["median_round_s"] / warm["median_round_s"], 2),
           idle_after_warm_idle_s_mb=round(adaptive["idle_after_rounds_mb"], 1), warm_idle_s=WARM_IDLE_S)  # fmt: skip


if __name__ == "__main__":
    main()
