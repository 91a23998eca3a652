"""A participant's half of a round, apart from whoever drives it: the edge agent's daemon, a peer, the
server's shared-pool trainer.

``RoundClient`` trains a round task on a runner (``participant.jobs``), encodes the result as an update
(``flcore.update``), writes it to disk before it is sent (``participant.progress``), seals it to its
destination (``participant.upload``) and counts it sent only once the broker acknowledged every chunk.
It never blocks: its owner's loop calls ``poll`` and ``check_upload`` between its other work and decides
from what they report (trained, declined, failed, cancelled; sent, timed out) what to do next and what to
tell its operator. Whether a task is genuine, whether the device may train now and what its status says
stay with the owner, which is why nothing here reads a gate, a status or a broker subscription.

Store and forward: while the link is down paho holds the chunks and re-sends them when it reconnects.
After a restart the owner re-sends the stored update (``resend``) if the round still accepts it; if the
round closed meanwhile the update is dropped with a logged reason (``drop_closed``): no strategy takes a
stale update into a later round (their bounds and averages assume updates against the current model).
Delivery is at least once: an update acknowledged just before a crash may be sent again after the
restart, and the receiver refuses the second copy (``duplicate``), so it counts once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flcore.update import TrainResult, encode_model, encode_update
from models.weights import NamedArrays, advanced
from participant.jobs import Cancelled, Declined, Failed, Job, Outcome, Runner, Trained
from participant.progress import RESIDUAL_FILE, Progress, ProgressStore
from participant.recipes import work_share
from participant.start_models import StartModels
from participant.trainer import PeerContext
from participant.upload import PUBLISH_TIMEOUT_S, Upload, send_sealed
from protocol.messages import AgentStart, RoundTask
from protocol.mqtt import MqttClient
from security.keys import Identity, PublicIdentity

Warn = Callable[..., None]  # the owner's throttled warning: (key, message, *args)


@dataclass
class Training:
    """The round being trained: its task, start model and job."""

    task: RoundTask
    base: NamedArrays
    start: AgentStart
    job: Job
    started: float


@dataclass(frozen=True)
class RoundReport:
    """What became of a round's training. ``outcome`` is the job's: ``Trained`` once its update is encoded and
    stored, else ``Declined``, ``Failed`` or ``Cancelled``. ``update`` is the stored update to send (None after
    a local round: model swapping keeps that model here)."""

    task: RoundTask
    outcome: Outcome
    update: bytes | None = None


@dataclass(frozen=True)
class Destination:
    """Where this participant's updates go: sealed to ``recipient`` (the server, say) as ``kind`` on ``topic``."""

    topic: str
    recipient: PublicIdentity
    kind: str = "update"


class RoundClient:
    def __init__(
        self,
        name: str,
        runner: Runner,
        store: ProgressStore,
        *,
        identity: Identity | None = None,
        federation: str = "",
        destination: Destination | None = None,
        local_delta: float | None = None,
        whole_model: bool = False,
        log: logging.Logger | None = None,
        warn: Warn | None = None,
    ) -> None:
        """``local_delta``: the δ of local DP (an update says what its trainer's budget spent), None without it.
        ``log`` and ``warn`` are the owner's, so its journal reads as one daemon's. ``whole_model`` (a peer): the
        update carries the trained model (``flcore.update.encode_model``), not its change from the start model.
        ``identity`` and ``destination`` None: the owner sends the update itself (a peer seals it to every member)
        or keeps it (the server's pool)."""
        self.name = name
        self.runner = runner
        self.store = store
        self.progress = store.load()
        self.start_models = StartModels(store)
        self.identity, self.federation, self.destination = identity, federation, destination
        self.local_delta, self.whole_model = local_delta, whole_model
        self.log = log or logging.getLogger("skyfed.participant")
        self.warn = warn or (lambda _key, message, *args: self.log.warning(message, *args))
        self.training: Training | None = None
        self.upload: Upload | None = None
        self.failed: tuple[int, int] = (0, 0)  # (round, attempt) whose training failed or was declined

    # runs --------------------------------------------------------------------------------------------
    def new_run(self, run_id: str) -> bool:
        """Start over for a run other than the one the progress belongs to (a reset server): what was sealed
        to this participant before is of no use. True if ``run_id`` was new."""
        if run_id == self.progress.run_id:
            return False
        self.log.info("new server run run_id=%s (was %s): progress starts over", run_id, self.progress.run_id or "-")
        self.progress = Progress(run_id=run_id)
        self.store.save(self.progress)
        self.start_models.new_run()
        return True

    # training ----------------------------------------------------------------------------------------
    def continued(self, start: AgentStart) -> NamedArrays | None:
        """After local rounds (model swapping): this participant's model from them, when the task says to train on
        from it and it descends from the model the task names (else the round starts from that model)."""
        if not start.continues or self.progress.continued_from != start.sha256:
            return None
        return self.start_models.continued()

    def failed_on(self, task: RoundTask) -> bool:
        """Training failed or was declined on this attempt: the next attempt is the next try."""
        return self.failed == (task.round, task.attempt)

    def train(
        self,
        task: RoundTask,
        start: AgentStart,
        base: NamedArrays,
        *,
        export_to: Path | None = None,
        context: PeerContext | None = None,
    ) -> None:
        """Start training ``task`` from ``base`` (the model ``start`` names), or from the continued model."""
        continued = self.continued(start)
        job = self.runner.train(base if continued is None else continued, task, export_to, context)
        self.training = Training(task, base, start, job, time.perf_counter())

    def poll(self, *, cancel: str = "", refuse: str = "") -> RoundReport | None:
        """The report once the training job is over, else None. ``cancel`` stops a running job for that reason
        (a result that came first still counts); ``refuse`` drops one that came first (revoked: never sent)."""
        training = self.training
        assert training is not None
        if cancel:
            training.job.cancel(cancel)
        outcome = training.job.poll()
        if outcome is None:
            return None
        self.training = None
        task = training.task
        if refuse and not isinstance(outcome, Cancelled):
            outcome = Cancelled(refuse)
        if isinstance(outcome, Trained):
            return RoundReport(task, outcome, self._finish(training, outcome.result))
        if isinstance(outcome, (Declined, Failed)):
            self.failed = (task.round, task.attempt)
        return RoundReport(task, outcome)

    def _finish(self, training: Training, result: TrainResult) -> bytes | None:
        """Encode and store the update (None after a local round, whose model stays here) and record the round."""
        task, base, start = training.task, training.base, training.start
        self.log.info(
            "trained round=%d start=%s%s action=%s work=%g samples=%d weight=%d loss=%.4f seconds=%.2f",
            task.round,
            start.source,
            "+continued" if self.continued(start) is not None else "",
            task.action,
            work_share(task.train_of(self.name)),
            result.samples,
            result.weight or result.samples,
            result.loss,
            time.perf_counter() - training.started,
        )
        p = self.progress
        if task.action == "local":  # model swapping's local round: the model stays here, nothing is uploaded
            self.start_models.keep("continued", result.arrays, task.round)
            p.continued_from, p.last_completed_round, p.sent_round, p.sent_attempt = (
                start.sha256, task.round, task.round, task.attempt)  # fmt: skip
            self.store.save(p)
            return None
        residual = self.store.directory / RESIDUAL_FILE
        sent: NamedArrays | None = None  # the change the receiver decodes, when it is one from ``base``
        if self.whole_model:
            data = encode_model(task, base, result, residual=residual, local_delta=self.local_delta)
        else:
            data, sent = encode_update(task, base, result, residual=residual, local_delta=self.local_delta,
                                       base_sha256="" if start.source == "global" else start.sha256)  # fmt: skip
        self.store.store_update(task.round, data)
        if sent is not None and task.action != "average":  # the server keeps this participant's model: so does it
            self.start_models.keep("local", advanced(base, sent), task.round)
        p.last_completed_round = task.round
        self.store.save(p)
        return data

    def close(self, reason: str) -> None:
        if self.training is not None:
            self.training.job.cancel(reason)
        self.runner.close()

    # sending -----------------------------------------------------------------------------------------
    def owes(self, task: RoundTask) -> bool:
        """This participant trained ``task``'s round and nothing is in flight, but the broker acknowledged no
        update of it, or only for an earlier attempt (the receiver asks again: it may not have it)."""
        p, done = self.progress, self.progress.last_completed_round
        unsent = p.sent_round < done or (p.sent_round == done and task.attempt > p.sent_attempt)
        return task.round == done and unsent and self.upload is None

    def resend(self, task: RoundTask) -> bytes | None:
        """The stored update of ``task``'s round, to send again (None, said, when it is missing)."""
        data = self.store.stored_update(task.round)
        if data is None:
            self.warn("resend-missing", "cannot re-send round=%d: stored update missing", task.round)
            return None
        self.log.info("re-sending stored update round=%d attempt=%d", task.round, task.attempt)
        return data

    def drop_closed(self, current_round: int, folds: bool = False, late_rounds: int = 1) -> None:
        """Drop a stored update the broker never acknowledged once a later round is announced, unless that round
        still ``folds`` it in (``flcore.late``: up to ``late_rounds`` back) and it is in flight."""
        done = self.progress.last_completed_round
        if folds and 0 < current_round - done <= late_rounds and self.upload is not None:
            return
        if current_round > done > self.progress.sent_round and self.store.update_path(done).exists():
            self.store.drop_update(done)
            self.progress.sent_round = done  # settled: nothing of that round is left to send
            self.store.save(self.progress)
            self.log.warning("update dropped round=%d reason=round %d closed before its update reached the server "
                             "(now %d)", done, done, current_round)  # fmt: skip

    def send(self, mqtt: MqttClient, task: RoundTask, data: bytes, now: float) -> None:
        """Seal ``data`` at ``now`` (the receiver's time) and hand it to paho; it counts as sent once
        ``check_upload`` says so, which the owner's loop is woken for when its last chunk is acknowledged."""
        d = self.destination
        assert d is not None and self.identity is not None, "no destination: the owner sends its updates itself"
        self.upload = send_sealed(mqtt, d.topic, data, sender=self.identity, recipient=d.recipient,
                                  federation=self.federation, kind=d.kind, round=task.round,
                                  attempt=task.attempt, now=now)  # fmt: skip
        mqtt.wake_when_acknowledged(self.upload.infos[-1])  # the owner's loop checks it as the broker took it

    def check_upload(self, mqtt: MqttClient, newest: RoundTask | None) -> str:
        """``acknowledged`` (recorded as sent), ``timed-out`` (no longer waited for: paho keeps re-sending, and a
        later attempt that asks for it again gets it) or ``waiting``. An update the broker took without a break in
        the link answers every attempt of its round announced by then (``newest``, the owner's newest task): it is
        not sent twice. One whose acknowledged chunks may have died with a broker that went away answers only its
        own attempt, so a later one that asks for it gets it again."""
        upload = self.upload
        assert upload is not None
        state = upload.check(mqtt)
        if state == "acknowledged":
            self.upload = None
            asked = newest.attempt if newest is not None and newest.round == upload.round else 0
            self.record_sent(upload.round, upload.attempt if upload.broken else max(upload.attempt, asked))
            self.log.info("update sent round=%d chunks=%d bytes=%d", upload.round, len(upload.infos), upload.size)
        elif state == "timed-out":
            self.upload = None
            self.log.warning("update for round=%d not acknowledged after %.0f s", upload.round, PUBLISH_TIMEOUT_S)
        return state

    def forget_upload(self) -> None:
        """Stop waiting for the upload in flight (its receiver will refuse it: this participant was revoked)."""
        self.upload = None

    def record_sent(self, round_number: int, attempt: int) -> None:
        """The update of ``round_number`` needs no sending for ``attempt`` or before (durably)."""
        self.progress.sent_round, self.progress.sent_attempt = round_number, attempt
        self.store.save(self.progress)
