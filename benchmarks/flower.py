"""SkyFed and Flower side by side, in one run (``make bench``; needs the ``bench`` extra, which pins flwr).

Both arms federate SkyFed's digits CNN with FedAvg from the same initial model, on the same partition
(``sim.classify_layout.write_classify_data``: same files, same seed), with the same local loop (``train_sgd``: SGD,
learning rate, momentum, epochs, batch size) and the same batch order (``participant.classifier.round_seed``), one
PyTorch thread per client, and score each round's global model with the same ``evaluate`` on the same evaluation
set. So accuracy per round must agree (within a point; float sums in another order are all that differ), and time
is what the comparison measures.

* **SkyFed** as ``skyfed sim --worker deployed`` runs it: mosquitto, the server and one agent daemon per client,
  each agent starting its training child as ``skyfed agent run`` does by default. The influence bounds are off
  (``[bounds]``: clip, sample cap, change bound, collapse rollback, screening) so that both compute plain FedAvg.
  Its own defaults stay on, work Flower's arm does not do: each agent scores its start and trained models on its
  local test split and exports the global model to ONNX, and the server scores agents' start and trained models.
* **Flower** 1.42 as a deployment: ``flower-superlink`` and one ``flower-supernode`` per client on loopback,
  ``flwr run`` of the Flower App in ``benchmarks/flower_app`` (subprocess isolation, Flower's default), with no
  federated evaluation round (SkyFed has none) and Flower's telemetry, update check and runtime dependency
  installation off.

Reported, each as SkyFed / Flower: the median time between consecutive global models from round 2 on ("per
round"), and launch to final model (from starting the first process, data layout in a fresh interpreter included,
to the last round's global model being aggregated and scored). Setups: 4 agents IID and 10 agents with 2 label
shards each, 5 rounds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import report

SETUPS = (("iid", 4), ("shards", 10))
ROUNDS = 5
SEED = 1
TRAINING = {"epochs": 2, "batch-size": 32, "lr": 0.05, "momentum": 0.9}  # sim.settings' digits defaults, spelled out
PLAIN_FEDAVG = ("clip=off", "sample_multiple=0", "change_multiple=0", "collapse_ratio=0", "screen_below=0")
APP = Path(__file__).with_name("flower_app")
START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Arm:
    """One federation: when it was launched, when each round's global model was made (wall clock), its accuracy,
    and when the last one was ready (aggregated and scored)."""

    launched: float
    finished: list[float]
    accuracy: list[float]
    final: float

    def per_round_s(self) -> float:
        """The median gap between consecutive global models, from round 2 on (round 1 carries the start-up)."""
        return statistics.median(b - a for a, b in zip(self.finished, self.finished[1:], strict=False))

    def launch_to_final_s(self) -> float:
        return self.final - self.launched


def skyfed_arm(partition: str, agents: int, work: Path) -> Arm:
    flags = [flag for option in PLAIN_FEDAVG for flag in ("--bounds-option", option)]
    training = [flag for key, value in TRAINING.items() for flag in (f"--{key}", str(value))]
    command = [sys.executable, "-m", "skyfed", "sim", "--agents", str(agents), "--rounds", str(ROUNDS),
               "--partition", partition, "--seed", str(SEED), "--strategy", "fedavg", *flags, *training,
               "--worker", "deployed", "--out", str(work / "skyfed")]  # fmt: skip
    launched = time.time()
    run_to_end(command, dict(os.environ), work / "skyfed.log")
    rounds = [json.loads(line) for line in (work / "skyfed" / "metrics.jsonl").read_text().splitlines()]
    if [r["outcome"] for r in rounds] != ["committed"] * ROUNDS:
        raise RuntimeError(f"SkyFed committed {sum(r['outcome'] == 'committed' for r in rounds)} of {ROUNDS} rounds: "
                           f"see {work}")  # fmt: skip
    # finished_at is taken as a round closes (the gaps between rounds are alike); its metrics line is written once
    # the model is aggregated, scored and exported: that write is when the last one was ready, as Flower's scoring
    final = (work / "skyfed" / "federation" / "server" / "state" / "metrics.jsonl").stat().st_mtime
    return Arm(launched, [r["finished_at"] for r in rounds], [r["eval"]["accuracy"] for r in rounds], final)


LAYOUT = ("import sys; from pathlib import Path; from sim.classify_layout import write_classify_data; "
          "from sim.settings import agent_names; "
          "write_classify_data(Path(sys.argv[1]), agent_names(int(sys.argv[2])), sys.argv[3], int(sys.argv[4]))")


def flower_arm(partition: str, agents: int, work: Path) -> Arm:
    from sim.broker import free_port
    from sim.settings import agent_names

    env = flower_env(work)
    logs = work / "flower-logs"
    logs.mkdir()
    data = work / "flower-data"
    launched = time.time()  # the layout runs in a fresh interpreter, as skyfed sim's does in its own
    run_to_end([sys.executable, "-c", LAYOUT, str(data), str(agents), partition, str(SEED)], env, logs / "layout.log")
    port = free_port()
    (Path(env["FLWR_HOME"]) / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    processes = [spawn(["flower-superlink", "--insecure", "--port", str(port),
                        "--disable-runtime-dependency-installation"], env, logs / "superlink.log")]  # fmt: skip
    out = work / "flower-rounds.jsonl"
    try:
        wait_for_port(port)
        for name in agent_names(agents):
            node = ["--port", str(free_port()), "--node-config", f'agent="{name}" data="{data / name / "data.npz"}"']
            supernode = ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", *node]
            processes.append(spawn(supernode, env, logs / f"{name}.log"))
        run_config = {"agents": agents, "rounds": ROUNDS, "seed": SEED, "model": "digits_cnn", **TRAINING,
                      "test-data": str(data / "server" / "test.npz"), "out": str(out)}  # fmt: skip
        overrides = " ".join(f"{key}={json.dumps(value)}" for key, value in run_config.items())
        run_to_end(["flwr", "run", str(APP), "bench", "--stream", "--run-config", overrides], env,
                   logs / "flwr-run.log", watched=processes)  # fmt: skip
    finally:
        for process in reversed(processes):
            stop(process)
    rounds = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    scored = [r for r in rounds if r["round"] > 0]  # round 0: the initial model, before any training
    if len(scored) != ROUNDS:  # `flwr run --stream` exits 0 even when the ServerApp failed
        raise RuntimeError(f"Flower scored {len(scored)} of {ROUNDS} rounds: see {logs}")
    return Arm(launched, [r["at"] for r in scored], [r["accuracy"] for r in scored], scored[-1]["at"])


def flower_env(work: Path) -> dict[str, str]:
    """Flower's processes: its own home (the SuperLink connection), this environment's commands first on PATH (the
    SuperLink and SuperNodes start ``flwr-serverapp`` and ``flwr-clientapp`` by name), one OpenMP thread as
    ``skyfed sim`` gives its daemons, and nothing that would reach the internet: no telemetry, no update check, no
    runtime installation of the app's dependencies."""
    home = work / "flower-home"
    home.mkdir()
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip


def run_to_end(command: list[str], env: dict[str, str], log: Path, watched: Sequence[subprocess.Popen] = ()) -> None:
    """Run ``command`` to its end (a failure names its log), stopping it, and failing, when a process it needs
    (``watched``) exits first or ``RUN_TIMEOUT_S`` passes: a SuperNode that died would leave FedAvg waiting."""
    process = spawn(command, env, log)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while (code := process.poll()) is None:
            if gone := [p for p in watched if p.poll() is not None]:
                raise RuntimeError(f"{gone[0].args[0]} exited ({gone[0].returncode}) before {command[0]}: see "
                                   f"{log.parent}")  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(command[:4])} ran past {RUN_TIMEOUT_S:.0f} s: see {log}")
            time.sleep(0.2)
    finally:
        stop(process)
    if code != 0:
        raise RuntimeError(f"{' '.join(command[:4])} exited with {code}: see {log}")


def spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A process in its own session, so that ``stop`` also ends what it starts (app processes, daemons)."""
    with log.open("w") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_port(port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the Flower SuperLink did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S:.0f} s")


def stop(process: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def compare(partition: str, agents: int) -> None:
    setup = f"{agents} agents, {partition}, {ROUNDS} rounds"
    work = Path(tempfile.mkdtemp(prefix="skyfed-flower-"))  # kept when a run fails: the error names its logs
    skyfed, flower = skyfed_arm(partition, agents, work), flower_arm(partition, agents, work)
    shutil.rmtree(work, ignore_errors=True)
    gap = max(abs(a - b) for a, b in zip(skyfed.accuracy, flower.accuracy, strict=True)) * 100
    report("flower_accuracy_per_round", setup=setup, skyfed=str([round(a, 4) for a in skyfed.accuracy]),
           flower=str([round(a, 4) for a in flower.accuracy]), largest_gap_points=round(gap, 2),
           target="within 1 point every round", ok=gap <= 1.0)  # fmt: skip
    per_round = skyfed.per_round_s() / flower.per_round_s()
    report("flower_per_round", setup=setup, skyfed_s=round(skyfed.per_round_s(), 3),
           flower_s=round(flower.per_round_s(), 3), ratio=round(per_round, 4), target="<= 0.05x Flower's",
           ok=per_round <= 0.05)  # fmt: skip
    launch = skyfed.launch_to_final_s() / flower.launch_to_final_s()
    report("flower_launch_to_final_model", setup=setup, skyfed_s=round(skyfed.launch_to_final_s(), 1),
           flower_s=round(flower.launch_to_final_s(), 1), ratio=round(launch, 3), target="<= 0.1x Flower's",
           ok=launch <= 0.1)  # fmt: skip


def main() -> None:
    try:
        import flwr  # noqa: F401 - only to say how to get it
    except ImportError:
        print(json.dumps({"benchmark": "flower", "skipped": "flwr is not installed: make bench installs the bench "
                          "extra (pip install -c constraints.txt -e '.[bench]')"}))  # fmt: skip
        return
    for partition, agents in SETUPS:
        compare(partition, agents)


if __name__ == "__main__":
    main()
