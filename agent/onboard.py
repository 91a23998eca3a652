"""The agent's copy of the newest global model as ONNX, for its on-board detector (``skyfed agent infer``).

The newest global model version the agent holds is exported once to ``<state_dir>/global_model.onnx``
(``models.onnx_export``, in the training child: written only after onnxruntime reproduced PyTorch; a failed
export keeps the previous file and is logged). The export needs the round task (model name, classes, image
size), so it runs once a task and a newer model are here, whichever came last, and only while no training runs
(training goes first). A version is exported once it has been the newest held for ``SETTLE_S``: a round's
training usually takes longer than that, so its start model is exported as its update leaves, but rounds that
follow each other faster than the export is worth (a digits CNN's 0.3 s rounds, each export 0.2 CPU-s on a
device whose cores the training needs) export only the version they stop at. The last round's model, which no
task names, is exported with the last task's description once that task's deadline has passed. The export of a
version no training job carries runs as a job of its own on the agent's runner (``job``), cancelled when the
gate closes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from models.weights import NamedArrays
from participant.jobs import Exported, Job, Outcome, Runner
from protocol.messages import RoundTask

log = logging.getLogger("skyfed.agent")
SETTLE_S = 2.0  # how long a version must have been the newest held before it is exported


class OnboardModel:
    def __init__(self, state_dir: Path, runner: Runner, enabled: bool = True) -> None:
        self.path = state_dir / "global_model.onnx"
        self.runner = runner
        self.enabled = enabled
        self.version = 0  # the newest version exported (or tried)
        self.job: Job | None = None  # an export of its own (not riding along with a training job)
        self.newest = (0, 0.0)  # the newest version held, and since when (time.monotonic())

    def wanted(self, task: RoundTask | None, version: int, now: float) -> bool:
        """Should global model ``version`` be exported now? ``task`` (the newest round task) describes it: the
        model, classes and image size stay the same for a run. A version no task names yet is the last
        round's model or the next round's start; it waits until ``task``'s deadline has passed, so that it
        never holds up the next round's training. The export of the round's own start model runs once the
        round's update is sent, while the round waits for the others (a per-round training child carries it
        along with the training job instead: one child start a round). For the round's last agent the next
        task may come during that export, and its training then waits for it (docs/results/scale.md)."""
        if not self.enabled or task is None or version <= self.version or task.share != "full":
            return False  # under partial aggregation the global model is only part of this agent's
        return version == task.model_version or now > task.deadline

    def started(self, version: int) -> None:
        self.version = version  # tried once, whatever the outcome

    def finished(self, outcome: Outcome) -> None:
        if isinstance(outcome, Exported):
            log.info("onnx model kept version=%d path=%s %s", self.version, self.path, outcome.detail)
        else:
            log.warning("onnx export failed version=%d reason=%s (the previous file stays)", self.version,
                        getattr(outcome, "reason", outcome))  # fmt: skip

    def hold(self, version: int) -> None:
        """The newest global model version the agent holds now (told at every step, training or not)."""
        if version != self.newest[0]:
            self.newest = (version, time.monotonic())

    def settled(self, version: int) -> bool:
        """Whether ``version`` has been the newest held for ``SETTLE_S``."""
        return version == self.newest[0] and time.monotonic() - self.newest[1] >= SETTLE_S

    def export_newest(self, task: RoundTask | None, models: dict[int, NamedArrays], now: float) -> None:
        """No training runs: export the newest global model held, if it wants exporting and has settled."""
        held = max(models, default=0)
        if self.settled(held) and task is not None and self.wanted(task, held, now):
            self.job = self.runner.export(models[held], task, self.path)
            self.started(held)  # after: whoever sees this version as started sees its job too

    def check(self, gated: bool) -> None:
        """Poll the export job (cancelled while the gate is closed)."""
        assert self.job is not None
        if gated:
            self.job.cancel("gate closed")
        if (outcome := self.job.poll()) is not None:
            self.job = None
            self.finished(outcome)
