"""The agent's round work, step by step from its loop: train, send, re-send, export ONNX, all without blocking.

Each ``_step`` looks at where the current round stands and does at most one small thing: start a job on
the runner (``agent.runner``: training in a child process, started ahead as soon as a round selects this
agent, released after an idle time), poll it, hand a sealed update to paho, or check
that the broker acknowledged it. The device's gate (``agent.telemetry``) is asked before anything heavy
starts and while a training job runs: a gate that closes mid-round (the drone arms, say) cancels the job,
and an update trained just before it closed stays on disk, unsent, until the gate opens again (it is then
re-sent if the server still waits for it). A cancelled round is not a failure: once the gate opens and the
round is still open, it trains again.

Store and forward: every update is written to disk before it is handed to paho (``agent.state``), and
counts as sent only once the broker acknowledged every chunk (``participant.upload``: while the link is
down paho holds the chunks and re-sends them when it reconnects). After a restart the stored update is sent
again if the server's retained task still lists this agent as pending (the round still accepts it).
If the round closed meanwhile the update is dropped with a logged reason: no strategy here takes a
stale update into a later round (their bounds and averages assume updates against the current model).
Delivery is at least once: an update acknowledged just before a crash may be sent again after the
restart, and the server refuses the second copy (``duplicate``), so it counts once.

``RoundWork`` is a part of ``agent.daemon.EdgeAgent`` (which holds the state it uses), kept apart so
each module has one job: the daemon speaks MQTT and keeps state, this decides and does the work.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.state import RESIDUAL_FILE
from flcore.update import TrainResult, encode_update
from models.weights import NamedArrays, advanced
from participant.jobs import Cancelled, Declined, Failed, Job, Trained
from participant.upload import PUBLISH_TIMEOUT_S, send_sealed
from protocol.messages import AgentStart, RoundTask

if TYPE_CHECKING:
    from agent.daemon import EdgeAgent

log = logging.getLogger("skyfed.agent")


@dataclass
class Training:
    """The round being trained: its task, start model and job."""

    task: RoundTask
    base: NamedArrays
    start: AgentStart
    job: Job
    started: float


class RoundWork:
    def _step(self: EdgeAgent) -> None:
        self.runner.release_idle()
        if self.revoked:
            self.upload = None  # whatever is still in flight, the server refuses (unknown-sender)
        if self.upload is not None:
            self._check_upload()
        if self.training is not None:
            return self._check_training()
        if self.revoked:
            return self._set_state("revoked")
        if self.export is not None:
            return self._check_export()
        task = self.task
        if task is not None and (refusal := self.profile.refusal(task)) != self.refusal:
            self.refusal = refusal
            if refusal:
                log.warning("cannot train this federation's model: %s", refusal)
            self._publish_status(force=True)
        done = self.progress.last_completed_round
        if task is not None and task.round > done > self.progress.sent_round and self.store.update_path(done).exists():
            self._drop_unsent(done, f"round {done} closed before its update reached the server (now {task.round})")
        gated = self.telemetry.reasons()
        if gated:
            return self._gated(gated)
        if task is None or self.id not in task.selected or task.expired(self.server_time()) or self.refusal:
            return self._idle()
        if task.round < done:
            return self._idle()
        if task.round == done:
            p = self.progress
            unsent = p.sent_round < done or (p.sent_round == done and task.attempt > p.sent_attempt)
            if self.id in task.pending and unsent and self.upload is None:
                self._resend(task)
            return self._idle("done")
        if self.failed == (task.round, task.attempt):
            return None  # failed or declined on this attempt; the server's re-announcement is the next try
        self.runner.prepare((task.run_id, task.round, task.attempt))  # its start-up overlaps the model's download
        start = task.start_of(self.id)
        base = self.inbox.start_model(task, start)
        context = self.inbox.peer_context(task, start) if start.peers_sha256 else None
        if base is None or (start.peers_sha256 and context is None):
            return self._idle("waiting-model")
        export_to = None
        train_from = self._trained_on(start) or base
        if train_from is base and start.source == "global" and self.onboard.wanted(task, task.model_version,
                                                                                   self.server_time()):
            self.onboard.started(task.model_version)
            export_to = self.onboard.path  # the global model rides along with the training job
        job = self.runner.train(train_from, task, export_to, context)
        self.training = Training(task, base, start, job, time.perf_counter())
        self._set_state("training", publish=True)
        return None

    def _trained_on(self: EdgeAgent, start: AgentStart) -> NamedArrays | None:
        """After local rounds (model swapping): this agent's model from them, when the task says to train on
        from it and it descends from the model the task names (else the round starts from that model)."""
        if not start.continues or self.progress.continued_from != start.sha256:
            return None
        return self.start_models.continued()

    def _gated(self: EdgeAgent, reasons: list[str]) -> None:
        if self.state != "gated":
            log.info("gate closed: %s", "; ".join(reasons))
        self._set_state("gated")

    def _idle(self: EdgeAgent, state: str = "idle") -> None:
        """Nothing to train: the turn of the on-board ONNX export, if a new global model wants one."""
        if self.state not in ("declined", "failed") or state != "idle":
            self._set_state(state)
        held = max(self.models, default=0)
        if self.onboard.wanted(self.task, held, self.server_time()) and self.task is not None:
            self.export = self.runner.export(self.models[held], self.task, self.onboard.path)
            self.onboard.started(held)  # after: whoever sees this version as started sees its job too

    def _check_export(self: EdgeAgent) -> None:
        assert self.export is not None
        if self.telemetry.reasons():
            self.export.cancel("gate closed")
        if (outcome := self.export.poll()) is not None:
            self.export = None
            self.onboard.finished(outcome)

    def _check_training(self: EdgeAgent) -> None:
        training = self.training
        assert training is not None
        task = training.task
        if gated := self.telemetry.reasons():
            training.job.cancel(f"gate closed: {'; '.join(gated)}")
        elif self.revoked:
            training.job.cancel(f"revoked by the server: {self.revoked}")
        elif self.task is not None and self.task.round != task.round:
            training.job.cancel(f"round {task.round} was superseded by round {self.task.round}")
        elif task.expired(self.server_time()):
            training.job.cancel(f"round {task.round}'s task expired during training")
        outcome = training.job.poll()
        if outcome is None:
            return
        self.training = None
        if self.revoked and not isinstance(outcome, Cancelled):  # it finished as the notice came: not sent
            outcome = Cancelled(f"revoked by the server: {self.revoked}")
        if isinstance(outcome, Trained):
            if outcome.export is not None:
                self.onboard.finished(outcome.export)
            return self._finish(training, outcome.result)
        if isinstance(outcome, Cancelled):
            log.warning("training stopped round=%d attempt=%d: %s", task.round, task.attempt, outcome.reason)
            return self._set_state("gated" if gated else "idle", publish=True)
        self.failed = (task.round, task.attempt)
        if isinstance(outcome, Declined):
            self._warn("declined", "round declined round=%d reason=%s", task.round, outcome.reason)
            self.detail = f"training declined: {outcome.reason}"  # the operator's monitor shows why
            return self._set_state("declined", publish=True)
        assert isinstance(outcome, Failed)
        log.error("training failed round=%d attempt=%d: %s", task.round, task.attempt, outcome.reason)
        self.errors, self.detail = self.errors + 1, f"training failed: {outcome.reason}"
        return self._set_state("failed", publish=True)

    def _finish(self: EdgeAgent, training: Training, result: TrainResult) -> None:
        task, base, start = training.task, training.base, training.start
        log.info(
            "trained round=%d start=%s%s action=%s work=%g samples=%d weight=%d loss=%.4f seconds=%.2f",
            task.round,
            start.source,
            "+continued" if self._trained_on(start) is not None else "",
            task.action,
            task.train_of(self.id).work,
            result.samples,
            result.weight or result.samples,
            result.loss,
            time.perf_counter() - training.started,
        )
        self.detail = ""
        if task.action == "local":  # model swapping's local round: the model stays here, nothing is uploaded
            self.start_models.keep("continued", result.arrays, task.round)
            p = self.progress
            p.continued_from, p.last_completed_round, p.sent_round, p.sent_attempt = (
                start.sha256, task.round, task.round, task.attempt)  # fmt: skip
            self.store.save(p)
            return self._set_state("done", publish=True)  # its status tells the server (last_completed_round)
        local_delta = self.config.privacy.delta if self.privacy is not None else None
        data, sent = encode_update(task, base, result, residual=self.store.directory / RESIDUAL_FILE,
                                   base_sha256="" if start.source == "global" else start.sha256,
                                   local_delta=local_delta)  # fmt: skip
        self.store.store_update(task.round, data)
        if task.action != "average":  # the server keeps this agent's model: so does the agent, bit for bit
            self.start_models.keep("local", advanced(base, sent), task.round)
        self.progress.last_completed_round = task.round
        self.store.save(self.progress)
        if gated := self.telemetry.reasons():  # kept on disk, unsent: re-sent once the gate opens (``_step``)
            return self._gated(gated)
        return self._send(task, data)

    def _resend(self: EdgeAgent, task: RoundTask) -> None:
        data = self.store.stored_update(task.round)
        if data is None:
            self._warn("resend-missing", "cannot re-send round=%d: stored update missing", task.round)
            return
        log.info("re-sending stored update round=%d attempt=%d", task.round, task.attempt)
        self._send(task, data)

    def _drop_unsent(self: EdgeAgent, round_number: int, reason: str) -> None:
        self.store.drop_update(round_number)
        self.progress.sent_round = round_number  # settled: nothing of that round is left to send
        self.store.save(self.progress)
        log.warning("update dropped round=%d reason=%s", round_number, reason)

    def _send(self: EdgeAgent, task: RoundTask, data: bytes) -> None:
        """Seal and hand to paho; the update counts as sent once the broker acknowledged every chunk
        (``_check_upload``, from the loop: the daemon never blocks on the network)."""
        self.upload = send_sealed(self.mqtt, self.topics.agent_update(self.id), data, sender=self.identity,
                                  recipient=self.server, federation=self.topics.federation, kind="update",
                                  round=task.round, attempt=task.attempt)  # fmt: skip
        self._set_state("uploading", publish=True)

    def _check_upload(self: EdgeAgent) -> None:
        """An update the broker took without a break in the link answers every attempt of its round announced
        by then (the server asked again while it trained or was offline, say): it is not sent twice. One whose
        acknowledged chunks may have died with a broker that went away answers only its own attempt, so a
        later one that lists this agent as pending gets it again."""
        upload = self.upload
        assert upload is not None
        state = upload.check(self.mqtt)
        if state == "acknowledged":
            self.upload = None
            asked = self.task.attempt if self.task is not None and self.task.round == upload.round else 0
            attempt = upload.attempt if upload.broken else max(upload.attempt, asked)
            self.progress.sent_round, self.progress.sent_attempt = upload.round, attempt
            self.store.save(self.progress)
            log.info("update sent round=%d chunks=%d bytes=%d", upload.round, len(upload.infos), upload.size)
            self._set_state("done", publish=True)
        elif state == "timed-out":
            self.upload = None  # paho keeps re-sending it; a later attempt that lists it pending re-sends it
            log.warning("update for round=%d not acknowledged after %.0f s", upload.round, PUBLISH_TIMEOUT_S)
