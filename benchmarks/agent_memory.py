"""``python -m benchmarks.agent_memory``: the agent daemon's memory idle and per round, per-round vs warm child.

A real federation of one agent (``skyfed agent run``, the digits CNN) and a server over a mosquitto this
benchmark starts. For each ``training.worker``: the daemon's resident memory (VmRSS) once connected with
no server (idle), the peak of daemon + training child while rounds run (sampled every 0.1 s), the idle
memory after the rounds, and the round times from the server's ``metrics.jsonl`` (the first round pays
the child's start-up; per-round children pay it every round). Baseline in the same run: a process that
imports what the agent daemon imported before its training moved to a child (the daemon plus PyTorch
and the classifier trainer), idle. Target (issue 11): idle ≤ 80 MB.
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
from sim.broker import start_broker
from sim.federation import SimSettings, create_federation
from sim.run import spawn

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20
ROUNDS = 4


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
    """What the daemon held when it imported PyTorch and built its trainer itself (before issue 11)."""
    code = "import agent.daemon, agent.classifier, models.zoo, torch; torch.zeros(1); import time; time.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        time.sleep(8.0)
        return rss(process.pid)
    finally:
        process.kill()
        process.wait()


def measure(worker: str, work: Path) -> dict:
    broker = start_broker(data_dir=work / "broker")
    try:
        settings = SimSettings(agents=1, rounds=ROUNDS, worker=worker, deadline_s=300.0, strategy={"name": "fedavg"})
        layout = create_federation(work / "fed", settings, (broker.host, broker.port))
        agent_log, server_log = work / "agent.log", work / "server.log"
        agent = spawn(["agent", "run", "--config", str(layout.agent_configs["agent-01"])], agent_log)
        try:
            wait_for_line(agent_log, "mqtt connected")
            time.sleep(3.0)
            idle = rss(agent.pid)
            server = spawn(["server", "run", "--config", str(layout.server_config)], server_log)
            peak = daemon_peak = 0
            while server.poll() is None:
                daemon = rss(agent.pid)
                daemon_peak = max(daemon_peak, daemon)
                peak = max(peak, daemon + sum(rss(pid) for pid in _descendants(agent.pid)))
                time.sleep(0.1)
            time.sleep(3.0)
            after = rss(agent.pid) + sum(rss(pid) for pid in _descendants(agent.pid))
        finally:
            agent.terminate()
            agent.wait(30)
        metrics = [json.loads(line) for line in (layout.server_config.parent / "state" / "metrics.jsonl").open()]
    finally:
        broker.stop()
    rounds = [m["duration_s"] for m in metrics]
    return {"idle_mb": idle / MB, "daemon_peak_mb": daemon_peak / MB, "peak_with_child_mb": peak / MB,
            "idle_after_rounds_mb": after / MB, "first_round_s": rounds[0],
            "later_round_s": statistics.median(rounds[1:]), "rounds": len(rounds)}  # fmt: skip


def main() -> None:
    baseline = baseline_idle_rss()
    with tempfile.TemporaryDirectory(prefix="skyfed-agent-memory-") as tmp:
        results = {worker: measure(worker, Path(tmp) / worker) for worker in ("per-round", "warm")}
    per_round = results["per-round"]
    report("agent_idle_rss", target="idle daemon <= 80 MB (issue 11)", ok=per_round["idle_mb"] <= 80,
           idle_mb=round(per_round["idle_mb"], 1), baseline_torch_in_daemon_mb=round(baseline / MB, 1),
           ratio=round(baseline / MB / per_round["idle_mb"], 2))  # fmt: skip
    for worker, figures in results.items():
        report(f"agent_rounds_{worker}", target="measured: which worker fits which device (README)", ok=True,
               **{key: round(value, 2) for key, value in figures.items()})  # fmt: skip


if __name__ == "__main__":
    main()
