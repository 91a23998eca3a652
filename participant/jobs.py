"""Training and export jobs that a participant's loop polls without blocking: their outcomes, the
``Runner`` interface, and the runner that trains on a thread of this process (simulation hosts, the
server's shared-pool trainer, tests). The deployed agent's runner, a child process holding PyTorch, is
``agent.runner.ChildRunner``."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Union

from flcore.update import TrainResult
from models.weights import NamedArrays
from participant.declined import TrainingDeclined
from participant.trainer import PeerContext, Trainer, TrainerWrapper
from protocol.messages import RoundTask

log = logging.getLogger("skyfed.participant")


@dataclass(frozen=True)
class Trained:
    result: TrainResult
    export: Outcome | None = None  # the ONNX export of the start model that rode along, if one was asked for


@dataclass(frozen=True)
class Exported:
    detail: str  # e.g. "max_abs_diff=3e-06 seconds=1.2"


@dataclass(frozen=True)
class Declined:
    reason: str


@dataclass(frozen=True)
class Failed:
    reason: str


@dataclass(frozen=True)
class Cancelled:
    reason: str  # the daemon stopped it: a gate closed, the round moved on, the agent stops


JOINING = "joining"  # ``Runner.prepare``'s key for an agent that started and waits for its first task
Outcome = Union[Trained, Exported, Declined, Failed, Cancelled]  # noqa: UP007 - Python 3.10 agents evaluate it at import


class Job(Protocol):
    kind: str  # "train" | "export"

    def poll(self) -> Outcome | None:
        """The outcome once the job is over, else None (never blocks)."""

    def cancel(self, reason: str) -> None:
        """Stop the job; its outcome becomes ``Cancelled(reason)`` and any result is dropped."""


def no_one() -> None:
    """The default ``Runner.notify``: no loop waits to be told."""


class Runner(Protocol):
    notify: Callable[[], None]  # called from the job's thread as it ends: its owner's loop wakes (``MqttClient.wake``)

    def train(
        self, base: NamedArrays, task: RoundTask, export_to: Path | None = None, context: PeerContext | None = None
    ) -> Job:
        """Train ``task`` from ``base`` (with FedAMN's ``context``); with ``export_to``, also export ``base`` (the
        global model) to ONNX afterwards, in the same child: a per-round child then starts once per round."""

    def export(self, arrays: NamedArrays, task: RoundTask, path: Path) -> Job: ...

    def prepare(self, key: object) -> None:
        """A round is near: one that selects this agent was announced (``key``: its run, round and attempt), or
        the agent is joining (``JOINING``: started, gate open, no task yet). Get ready."""

    def release_idle(self, gate_closed: bool = False) -> None:
        """Give back what an idle runner holds, once it has been idle long enough (a closed gate: at once)."""

    def close(self) -> None: ...


# -- in this process (simulation hosts, tests) ----------------------------------------------------------
class ThreadJob:
    """A job on a thread of this process; a cancelled one finishes in the background, its result dropped."""

    def __init__(self, kind: str, work: Callable[[], Outcome], notify: Callable[[], None] = no_one) -> None:
        self.kind = kind
        self._outcome: Outcome | None = None
        self._cancelled: Cancelled | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(work, notify), name=f"{threading.current_thread().name}-{kind}"
        )
        self._thread.start()

    def _run(self, work: Callable[[], Outcome], notify: Callable[[], None]) -> None:
        self._outcome = run_guarded(work)
        self._done.set()
        notify()

    def poll(self) -> Outcome | None:
        return self._cancelled or (self._outcome if self._done.is_set() else None)

    def cancel(self, reason: str) -> None:
        if self.poll() is None:
            self._cancelled = Cancelled(reason)


class OnSharedCores(TrainerWrapper):
    """Trains once one of ``cores`` is free: agents hosted in one process (``sim.agent_host``) share it, so that a
    few train at a time near full speed instead of all of them at once on a share of the cores and of the
    interpreter's lock (docs/results/scale.md). The wait counts as training time, as waiting for a core does
    anywhere; a wrapper's own wait (``sim.slow``) happens outside it and holds no core."""

    def __init__(self, inner: Trainer, cores: threading.Semaphore) -> None:
        super().__init__(inner)
        self.cores = cores

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        with self.cores:
            return self.inner.train(global_arrays, task, context)


class InProcessRunner:
    """``cores``: shared by the runners of agents hosted together, each training or export waiting for one of
    them; None: every job starts at once."""

    def __init__(self, trainer: Trainer, cores: threading.Semaphore | None = None) -> None:
        self.trainer = trainer if cores is None else OnSharedCores(trainer, cores)
        self.cores = cores
        self.notify: Callable[[], None] = no_one

    def train(
        self, base: NamedArrays, task: RoundTask, export_to: Path | None = None, context: PeerContext | None = None
    ) -> Job:
        return ThreadJob("train", lambda: train_and_export(self.trainer, base, task, export_to, context), self.notify)

    def export(self, arrays: NamedArrays, task: RoundTask, path: Path) -> Job:
        def work() -> Outcome:
            with self.cores or contextlib.nullcontext():
                return export_onnx(arrays, task, path)

        return ThreadJob("export", work, self.notify)

    def prepare(self, key: object) -> None:
        """The trainer is built already."""

    def release_idle(self, gate_closed: bool = False) -> None:
        """The trainer belongs to the hosting process."""

    def close(self) -> None:
        """Nothing to stop: a running thread job ends on its own."""


# -- the job itself, wherever it runs -------------------------------------------------------------------
def run_guarded(work: Callable[[], Outcome]) -> Outcome:
    """A trainer bug or bad data becomes a ``Failed`` outcome (logged with its traceback), not a crash."""
    try:
        return work()
    except TrainingDeclined as exc:
        return Declined(str(exc))
    except Exception as exc:  # noqa: BLE001 - whatever the trainer raises, the daemon carries on
        log.exception("job failed: %s", exc)
        return Failed(f"{type(exc).__name__}: {exc}")


def train_and_export(
    trainer: Trainer, base: NamedArrays, task: RoundTask, export_to: Path | None, context: PeerContext | None = None
) -> Outcome:
    trained = run_guarded(lambda: Trained(trainer.train(base, task, context)))
    if export_to is None or not isinstance(trained, Trained):
        return trained
    return Trained(trained.result, run_guarded(lambda: export_onnx(base, task, export_to)))


def export_onnx(arrays: NamedArrays, task: RoundTask, path: Path) -> Outcome:
    """``models.onnx_export.export_global`` of the task's model (written only if onnxruntime reproduced it)."""
    from models.onnx_export import export_global

    names = task.classes or [str(i) for i in range(task.num_classes)]
    report = export_global(task.model, arrays, path, names=names, image_size=task.train.image_size)
    if not report.ok:
        return Failed(f"onnx export failed: {report.reason}")
    return Exported(f"max_abs_diff={report.max_abs_diff:.2g} seconds={report.seconds:.2f}")
