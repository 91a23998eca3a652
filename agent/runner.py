"""Where the agent's heavy work runs: training a round and exporting the newest global model to ONNX.

The daemon holds MQTT, keys and state; PyTorch (and Ultralytics) live in a **training child** (``python -m
agent.training_child``). ``training.worker`` says when it lives: ``"adaptive"`` (the default) starts it as the
agent joins (its gate open, no task yet: a round usually follows) and as soon as a round that selects this
agent is announced, so PyTorch's start-up overlaps the server's and the model's download, keeps it while
rounds keep coming and gives its memory back after ``training.warm_idle_s`` without a job; ``"per-round"``
starts it for each job (nothing of PyTorch stays between rounds, a start-up every round); ``"warm"`` keeps it
for good (its memory stays taken). One job at a time. A job is polled from the daemon's loop, so MQTT
keep-alives, status and the systemd watchdog go on while it runs; it can be cancelled (the child is killed: a
gate that closes mid-round, a stop, an expired task) and is killed when it passes ``training.time_limit_s``. A
child that crashes is a failed job, never a dead daemon. Simulation hosts and tests run a trainer in their own
process instead (``participant.jobs``), so agents hosted together share one process and one PyTorch.
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from flcore.update import TrainResult
from models.serialization import load_file, save_file
from models.weights import NamedArrays
from participant.jobs import (
    JOINING,
    Cancelled,
    Declined,
    Exported,
    Failed,
    InProcessRunner,
    Job,
    Outcome,
    Trained,
    no_one,
)
from participant.trainer import PeerContext
from protocol.messages import RoundTask

if TYPE_CHECKING:
    from agent.config import AgentConfig

log = logging.getLogger("skyfed.agent")


def in_process_runner(config: AgentConfig, cores: threading.Semaphore | None = None) -> InProcessRunner:
    """The agent's own trainer in this process (imports PyTorch): ``sim.agent_host`` (its agents share ``cores``)
    and tests."""
    import torch

    from agent.device import torch_device
    from agent.trainers import build_trainer

    if config.training.threads > 0:
        torch.set_num_threads(config.training.threads)
    return InProcessRunner(build_trainer(config, torch_device(config.training.device)), cores)


# -- in a child process (the deployed agent) -----------------------------------------------------------
RESULT_FILE = "result.safetensors"
CONTEXT_FILE = "context.safetensors"  # FedAMN's other models (``PeerContext``), beside the start model
EXIT_GRACE_S = 10.0  # a per-round child that answered but has not exited by then is killed


def write_result(directory: Path, result: TrainResult) -> None:
    """The child's side: the trained arrays, and what the update's metadata needs."""
    meta = {"samples": result.samples, "loss": result.loss, "epsilon": result.epsilon, "weight": result.weight,
            "local_eval": result.local_eval, "start_eval": result.start_eval,
            "trained_eval": result.trained_eval}  # fmt: skip
    save_file(directory / RESULT_FILE, result.arrays, {"result": json.dumps(meta)})


def read_result(directory: Path) -> TrainResult:
    arrays, metadata = load_file(directory / RESULT_FILE)
    meta = json.loads(metadata["result"])
    return TrainResult(arrays=arrays, samples=int(meta["samples"]), loss=float(meta["loss"]), epsilon=meta["epsilon"],
                       weight=int(meta["weight"]), local_eval=dict(meta["local_eval"]),
                       start_eval=dict(meta.get("start_eval", {})),
                       trained_eval=dict(meta.get("trained_eval", {})))  # fmt: skip


def as_reply(outcome: Outcome) -> dict:
    """An outcome as the child's JSON reply (a train job's arrays travel in ``result.safetensors``)."""
    if isinstance(outcome, Trained):
        return {"ok": True} | ({"export": as_reply(outcome.export)} if outcome.export is not None else {})
    if isinstance(outcome, Exported):
        return {"exported": outcome.detail}
    if isinstance(outcome, Declined):
        return {"declined": outcome.reason}
    return {"failed": outcome.reason}


def from_reply(reply: dict) -> Outcome:
    """An export's or a refusal's outcome from its reply (not a train job's: that needs its result file)."""
    if "declined" in reply:
        return Declined(str(reply["declined"]))
    if "failed" in reply:
        return Failed(str(reply["failed"]))
    return Exported(str(reply.get("exported", "")))


class ChildJob:
    def __init__(self, kind: str, child: TrainingChild, directory: Path, limit_s: float) -> None:
        self.kind = kind
        self.child = child
        self.directory = directory
        self.deadline = time.monotonic() + limit_s
        self.limit_s = limit_s
        self._reply: dict | None = None
        self._replied_at = 0.0
        self._outcome: Outcome | None = None
        self.finished_at: float | None = None  # monotonic time its outcome was known

    def poll(self) -> Outcome | None:
        if self._outcome is None:
            self._outcome = self._check()
            self.finished_at = None if self._outcome is None else time.monotonic()
        return self._outcome

    def _check(self) -> Outcome | None:
        self._reply = self._reply or self.child.reply()
        if self._reply is None:
            if not self.child.alive() and (reply := self.child.last_reply()) is not None:
                self._reply = reply  # it answered, then exited before the reader had passed the answer on
            elif not self.child.alive():
                return Failed(f"training child {self.child.exit_description()} before finishing the {self.kind} job")
            elif time.monotonic() > self.deadline:
                self.child.kill()
                return Failed(f"time limit: the {self.kind} job ran longer than training.time_limit_s={self.limit_s:g}")
            else:
                return None
        if not self.child.warm and self.child.alive():  # a per-round child: done once it is gone, so two
            self._replied_at = self._replied_at or time.monotonic()  # children never hold PyTorch at once
            if time.monotonic() - self._replied_at < EXIT_GRACE_S:
                return None
            self.child.kill()
        return self._outcome_of(self._reply)

    def _outcome_of(self, reply: dict) -> Outcome:
        if self.kind == "export" or "ok" not in reply:
            return from_reply(reply)
        try:
            result = read_result(self.directory)
        except (OSError, ValueError, KeyError) as exc:
            return Failed(f"the training child's result cannot be read: {exc}")
        export = reply.get("export")
        return Trained(result, None if export is None else from_reply(export))

    def cancel(self, reason: str) -> None:
        if self._outcome is None:
            self.child.kill()
            self._outcome = Cancelled(reason)
            self.finished_at = time.monotonic()


class TrainingChild:
    """One ``python -m agent.training_child`` process: JSON requests on stdin, JSON replies on stdout."""

    def __init__(
        self, config_path: Path, worker: str, *, prepared_for: str = "", notify: Callable[[], None] = no_one
    ) -> None:
        """``prepared_for``: why it starts ahead of a job (it builds its trainer at once: ``--prepare``)."""
        self.warm = worker != "per-round"  # kept between jobs
        self._notify = notify  # a reply came, or the child ended: the daemon's loop looks at once
        self.started_at = time.monotonic()
        command = [sys.executable, "-m", "agent.training_child", "--config", str(config_path)]
        command += ["--prepare"] if prepared_for else []
        # stderr is the daemon's (journald): the child's log lines land next to the daemon's.
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._replies: queue.Queue[dict] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="training-child-reader", daemon=True)
        self._reader.start()
        log.info("training child started pid=%d worker=%s for=%s", self.process.pid, worker, prepared_for or "job")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:
                log.warning("training child wrote a line that is not a reply: %.200s", line)
                continue
            self._notify()
        self.process.wait()  # gone: a per-round child's job is done once it exits (``ChildJob``)
        self._notify()

    def send(self, request: dict) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        if not self.warm:
            self.process.stdin.close()  # one job, then the child exits and PyTorch's memory is returned

    def reply(self) -> dict | None:
        try:
            return self._replies.get_nowait()
        except queue.Empty:
            return None

    def last_reply(self) -> dict | None:
        """A gone child's last words: the reader reaches the end of its output, then the reply is in."""
        self._reader.join(timeout=2.0)
        return self.reply()

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_description(self) -> str:
        code = self.process.poll()
        return f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"

    def kill(self, why: str = "") -> None:
        if self.alive():
            self.process.kill()
            self.process.wait()
            log.info("training child stopped pid=%d%s", self.process.pid, why and f" {why}")


class ChildRunner:
    def __init__(self, config: AgentConfig) -> None:
        self.config_path = config.path
        self.worker = config.training.worker
        self.idle_s = config.training.warm_idle_s
        self.limit_s = config.training.time_limit_s
        self.jobs = config.state_dir / "jobs"
        self.child: TrainingChild | None = None
        self.job: ChildJob | None = None  # the newest job
        self.prepared_for: object = None  # what a child was last started ahead for: JOINING, or an announced round
        self.notify: Callable[[], None] = no_one

    def _start(self, kind: str, request: dict) -> ChildJob:
        if self.child is None or not self.child.alive() or not self.child.warm:
            self.child = TrainingChild(self.config_path, self.worker, notify=self.notify)
        self.child.send({"kind": kind, **request})
        self.job = ChildJob(kind, self.child, self.jobs / kind, self.limit_s)
        return self.job

    def prepare(self, key: object) -> None:
        """A kept child (adaptive, warm) starts now, once per key (``JOINING``, or an announced round): it imports
        PyTorch and loads the data while the server starts or the model downloads. A child released meanwhile
        is not started again for the same key."""
        if self.worker == "per-round" or key == self.prepared_for:
            return
        self.prepared_for = key
        if self.child is None or not self.child.alive():
            why = JOINING if key == JOINING else "announced-round"
            self.child = TrainingChild(self.config_path, self.worker, prepared_for=why, notify=self.notify)

    def release_idle(self, gate_closed: bool = False) -> None:
        """An adaptive child without a job for ``training.warm_idle_s`` exits: the idle agent is the daemon alone.
        A closed gate lets it go at once: a child started ahead (still importing PyTorch, perhaps) must not hold
        the device's cores and memory while it flies."""
        child, job = self.child, self.job
        if self.worker != "adaptive" or child is None or not child.alive():
            return
        if job is not None and job.child is child and job.finished_at is None:
            return  # a job runs
        last_job = job.finished_at if job is not None and job.child is child else None
        idle_s = time.monotonic() - (last_job or child.started_at)
        if gate_closed:
            child.kill(f"reason=gate-closed idle_s={idle_s:.0f}")
        elif idle_s >= self.idle_s:
            child.kill(f"reason=idle idle_s={idle_s:.0f} warm_idle_s={self.idle_s:g}")

    def _fresh_dir(self, kind: str) -> Path:
        directory = self.jobs / kind
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, mode=0o700)
        return directory

    def train(
        self, base: NamedArrays, task: RoundTask, export_to: Path | None = None, context: PeerContext | None = None
    ) -> Job:
        directory = self._fresh_dir("train")
        save_file(directory / "base.safetensors", base)
        if context is not None:
            save_file(directory / CONTEXT_FILE, context.to_arrays())
        request = {"dir": str(directory), "task": task.to_dict()}
        return self._start("train", request | ({"path": str(export_to)} if export_to else {}))

    def export(self, arrays: NamedArrays, task: RoundTask, path: Path) -> Job:
        directory = self._fresh_dir("export")
        save_file(directory / "base.safetensors", arrays)
        return self._start("export", {"dir": str(directory), "task": task.to_dict(), "path": str(path)})

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
