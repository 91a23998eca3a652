"""The edge agent: wait for a signed round task, fetch the global model, train, send the delta.

A role in an edge node (``agent.edge_node``: one MQTT connection and one thread of control, the gate, the
session's last will, the clock, Prometheus): received messages queue up and are handled between steps, so
training never blocks the network thread's keep-alives.
Only the newest signed task counts: an older (round, attempt) of the same server run, a task past its
``expires_at``, or a task from another federation is ignored, and the newest task is kept on disk, so a
replayed old task cannot stall the agent even after a restart. The round work itself (train, encode,
store, seal and send, durable progress, re-send after a restart) is a ``participant.round_client``
``RoundClient`` that this daemon drives from its loop (``_step``: at most one small thing per tick) and
whose reports decide the agent's state. Training and the ONNX export run as jobs of a runner
(``agent.runner``: a child process holding PyTorch). The gate (the status' ``gate.reasons``: the
device's telemetry, ``agent.telemetry``; the local privacy budget; its data profile, ``agent.profile``)
is asked before anything heavy starts and while a job runs: a gate that closes mid-round (the drone
arms, say) cancels the job, and an update trained just before it closed stays on disk, unsent, until
the gate opens again; a cancelled round is not a failure. Task times are judged on the server's clock
where this device's is measurably off (``agent.clock``), and every connection gets its own signed last
will, whose time every status of that connection names (the node's ``session``): the server refuses a will of
an earlier connection replayed.
"""

from __future__ import annotations

import logging
import threading
import time

import paho.mqtt.client as paho

from agent.config import AgentConfig
from agent.device import check_device_present
from agent.edge_node import EdgeNode
from agent.inbox import ServerInbox
from agent.onboard import OnboardModel
from agent.profile import StartFiles, privacy_view, read_start_files
from agent.run_end import RunEnd
from agent.runner import ChildRunner
from agent.standing import Standing
from agent.status_report import StatusReport
from agent.task_check import TaskRefused, checked_task
from agent.waiting import StuckNotice
from common.untrusted_json import UntrustedJsonError, parse_untrusted_json
from models.weights import NamedArrays
from participant.jobs import JOINING, Cancelled, Declined, Failed, Runner, Trained
from participant.progress import ProgressStore
from participant.round_client import Destination, RoundClient
from protocol.messages import MAX_JSON_BYTES, AgentStatus, RoundTask
from protocol.topics import Topics
from security.keys import GroupKey

log = logging.getLogger("skyfed.agent")


class EdgeAgent:
    """The client role: an edge node's work for a server (``run`` runs its node)."""

    def __init__(self, config: AgentConfig, *, runner: Runner | None = None, files: StartFiles | None = None) -> None:
        self.config = config
        self.id = config.agent.id
        self.topics = Topics(config.agent.federation)
        files = files or read_start_files(config)  # keys and data read and checked now: a bad one fails at start
        self.identity, self.server, self.profile = files.identity, files.server, files.profile
        self.privacy = privacy_view(config)
        if runner is None:  # the training child's PyTorch must see the GPU training.device names: say so now
            check_device_present(config.training.device)
        self.runner = runner or ChildRunner(config)
        self.refusal = ""  # why this agent cannot train the federation's model (its gate says so)
        self.revoked = ""  # why the server withdrew this agent's enrolment (a signed task said so); "" if not
        self.onboard = OnboardModel(config.state_dir, self.runner, config.training.onnx)
        self.client = RoundClient(self.id, self.runner, ProgressStore(config.state_dir), identity=self.identity,
                                  federation=self.topics.federation,
                                  destination=Destination(self.topics.agent_update(self.id), self.server),
                                  local_delta=config.privacy.delta if self.privacy is not None else None,
                                  log=log, warn=self._warn)  # fmt: skip
        self.inbox = ServerInbox(self.identity, self.server, self.topics.federation, self.client.start_models,
                                 self._warn)  # fmt: skip
        self.task: RoundTask | None = None
        self.unsaved_task: dict | None = None  # the task's signed document, saved once its step started a job
        self.state = "starting"
        self.detail = ""
        self.stuck = StuckNotice()
        self.run_end = RunEnd(self.topics.federation)
        self.report = StatusReport(self)
        self.status_topic = self.topics.agent_status(self.id)
        self.edge = EdgeNode(config, self.identity, self, log)
        self.runner.notify = self.edge.mqtt.wake  # a finished job is sent at once, not a tick later
        stored = self.client.store.load_task()
        if stored is not None:
            self._consider_task(stored, persist=False)

    def run(self, stop: threading.Event | None = None) -> None:
        self.edge.run(stop)

    # EdgeRole ----------------------------------------------------------------------------------------
    def subscriptions(self) -> list[str]:
        return [self.topics.round, self.topics.agent_inbox(self.id), self.status_topic, self.topics.server_status]

    def started(self) -> None:
        log.info(
            "agent started id=%s federation=%s samples=%d last_completed_round=%d",
            self.id,
            self.topics.federation,
            self.profile.samples,
            self.client.progress.last_completed_round,
        )

    def handle(self, topic: str, payload: bytes) -> None:
        if topic == self.topics.round:
            self._on_task(payload)
        elif topic == self.topics.agent_inbox(self.id):
            self._on_transfer_chunk(payload, frozenset({"groupkey", "start", "peers", "model"}))  # model: resent to it
        elif topic == self.topics.server_status:
            if self.run_end.note(payload):
                log.info("run finished at the server: %s", self.run_end.detail())
                self.report.publish(force=True)
        elif (version := self.topics.model_version_of(topic)) is not None and payload:
            self._on_transfer_chunk(payload, frozenset({"model"}), version)

    def tick(self) -> None:
        self.inbox.expire()
        self._step()
        self._save_task()
        self._say_if_stuck()
        self.report.publish()

    def _say_if_stuck(self) -> None:
        stuck_s = self.stuck.due(not self.group_keys and self.edge.mqtt.connected.is_set(), time.monotonic())
        if stuck_s is not None:
            log.warning("no group key after %.0f s: %s", stuck_s, self.report.waiting_for())

    def final_status(self) -> paho.MQTTMessageInfo | None:
        if self.client.upload is not None:
            self._check_upload()  # an acknowledgement that arrived since the last tick still counts
        if self.onboard.job is not None:
            self.onboard.job.cancel("the agent is stopping")
        self.client.close("the agent is stopping")
        self.state = "offline"  # a clean stop says so itself; a crash leaves it to the LWT
        return self.report.publish(force=True)

    def offline(self, session: float) -> dict:
        return AgentStatus.offline(self.id, session=session).to_dict()

    def connected(self) -> None:
        self.report.last = 0.0  # the new session's first status goes out on the next tick

    def describe(self) -> str:
        return self.report.describe()

    def progress_fields(self) -> str:
        return f"round={self.task.round if self.task is not None else 0} model_version={max(self.models, default=0)}"

    def finished(self) -> bool:
        return False

    def standing(self) -> Standing:
        task_round = self.task.round if self.task is not None else 0
        last = self.client.progress.last_completed_round
        return Standing(self.state, task_round, last, tuple(self.report.gate_reasons()))

    # round tasks -------------------------------------------------------------------------------------
    def _on_task(self, payload: bytes) -> None:
        if not payload:
            return
        try:
            document = parse_untrusted_json(payload, max_bytes=MAX_JSON_BYTES)
        except UntrustedJsonError as exc:
            self._warn("task-malformed", "round task rejected reason=%s", exc)
            return
        self._consider_task(document, persist=True)

    def _consider_task(self, document: object, *, persist: bool) -> None:
        """Adopt a signed task if it is for us, unexpired and not older than the one we hold."""
        try:
            task = checked_task(document, self.server, self.topics.federation, self.task)
        except TaskRefused as refused:
            self._warn(refused.key, "%s", refused)
            return
        if persist and self.edge.clock.note_task(task, time.time()):
            self.report.publish(force=True)
        if persist and task.expired(self.server_time()):
            age = time.time() - task.issued_at
            self.detail = f"the newest round task had expired on arrival (issued {age:.0f} s ago by this device's " \
                          "clock): check this device's clock"  # fmt: skip
            self._warn("task-expired", "round task ignored reason=expired round=%d age_s=%.0f", task.round, age)
            return
        self.detail = ""
        self.client.new_run(task.run_id)
        self.task = task
        self._note_revocation(task)
        if persist:
            self.unsaved_task = document  # type: ignore[assignment]
            self.edge.mqtt.wake()  # the step acts on it now, not a tick later

    def _save_task(self) -> None:
        """Keep the newest task durably (``ProgressStore.save_task``) once the step that acts on it has started its
        training job: its fsync, tens of milliseconds where many agents share a disk, no longer delays the job. No
        upload can go out before it (the job is not done within the step that started it)."""
        if self.unsaved_task is not None:
            document, self.unsaved_task = self.unsaved_task, None
            self.client.store.save_task(document)

    def _note_revocation(self, task: RoundTask) -> None:
        """The server's signed task names this agent as revoked: stop training and sending (``_step``),
        saying so once; a later task that selects it again (a new key enrolled) ends that."""
        if self.id in task.revoked and not self.revoked:
            self.revoked = f"its enrolment was withdrawn (round {task.round} names it revoked)"
            log.error("revoked by the server: %s; this agent stops training and sending until it is enrolled "
                      "again (skyfed keys enroll on the server)", self.revoked)  # fmt: skip
        elif self.revoked and self.id in task.selected and self.id not in task.revoked:
            self.revoked = ""
            log.info("enrolled again: round %d selects this agent", task.round)

    def server_time(self) -> float:
        """The time on the server's clock, as this device's clock and the measured skew say (``agent.clock``)."""
        return self.edge.server_time()

    # round work ---------------------------------------------------------------------------------------
    def _step(self) -> None:
        """Where the current round stands decides at most one small thing: start a job on the runner (training
        starts ahead as soon as a round selects this agent), poll it, hand an update to paho, or check that
        the broker acknowledged it."""
        self.runner.release_idle()
        self.onboard.hold(max(self.models, default=0))
        if self.revoked:
            self.client.forget_upload()  # whatever is still in flight, the server refuses (unknown-sender)
        if self.client.upload is not None:
            self._check_upload()
        if self.client.training is not None:
            return self._check_training()
        if self.revoked:
            return self._set_state("revoked")
        if self.onboard.job is not None:
            return self.onboard.check(gated=bool(self.edge.telemetry.reasons()))
        task = self.task
        if task is not None and (refusal := self.profile.refusal(task)) != self.refusal:
            self.refusal = refusal
            if refusal:
                log.warning("cannot train this federation's model: %s", refusal)
            self.report.publish(force=True)
        if task is not None:
            self.client.drop_closed(task.round, folds=self.id in task.late, late_rounds=task.late_rounds)
        gated = self.edge.telemetry.reasons()
        if gated:
            return self._gated(gated)
        if task is None:
            self.runner.prepare(JOINING)  # a round usually follows: PyTorch's start-up overlaps the server's
        if task is None or self.id not in task.selected or task.expired(self.server_time()) or self.refusal:
            return self._idle()
        done = self.client.progress.last_completed_round
        if task.round < done:
            return self._idle()
        if task.round == done:
            if self.id in task.pending and self.client.owes(task):
                self._resend(task)
            return self._idle("uploading" if self.client.upload is not None else "done")  # done: once acknowledged
        if self.client.failed_on(task):
            return None  # failed or declined on this attempt; the server's re-announcement is the next try
        self.runner.prepare((task.run_id, task.round, task.attempt))  # its start-up overlaps the model's download
        start = task.start_of(self.id)
        base = self.inbox.start_model(task, start)
        context = self.inbox.peer_context(task, start) if start.peers_sha256 else None
        if base is None or (start.peers_sha256 and context is None):
            return self._idle("waiting-model")
        export_to = None
        rides_along = self.config.training.worker == "per-round"  # else exported once the update is sent (``_idle``)
        if rides_along and self.client.continued(start) is None and start.source == "global" and self.onboard.wanted(
            task, task.model_version, self.server_time()
        ):
            self.onboard.started(task.model_version)
            export_to = self.onboard.path  # the global model rides along with the training job: one child start
        self.client.train(task, start, base, export_to=export_to, context=context)
        self._set_state("training", publish=True)
        return None

    def _gated(self, reasons: list[str]) -> None:
        if self.state != "gated":
            log.info("gate closed: %s", "; ".join(reasons))
        self.runner.release_idle(gate_closed=True)
        self._set_state("gated")

    def _idle(self, state: str = "idle") -> None:
        """Nothing to train: the turn of the on-board ONNX export, if a new global model wants one."""
        if self.state not in ("declined", "failed") or state != "idle":
            self._set_state(state)
        if not self.refusal:  # a refused task's model is not this agent's to build (models.own.model_refusal)
            self.onboard.export_newest(self.task, self.models, self.server_time())

    def _check_training(self) -> None:
        """Cancel the job when the gate closes, the agent is revoked or its round moves on; then act on its report:
        send a trained update (kept unsent while the gate is closed), or say why there is none."""
        training = self.client.training
        assert training is not None
        task, gated = training.task, self.edge.telemetry.reasons()
        revoked = f"revoked by the server: {self.revoked}" if self.revoked else ""
        newest = self.task.round if self.task is not None else task.round
        folds = self.task is not None and 0 < newest - task.round <= self.task.late_rounds and \
            self.id in self.task.late  # flcore.late  # fmt: skip
        cancel = next(filter(None, (
            f"gate closed: {'; '.join(gated)}" if gated else "",
            revoked,
            f"round {task.round} was superseded by round {newest}" if newest != task.round and not folds else "",
            f"round {task.round}'s task expired during training" if task.expired(self.server_time()) else "",
        )), "")  # fmt: skip
        report = self.client.poll(cancel=cancel, refuse=revoked)  # finished as the revocation came: not sent
        if report is None:
            return None
        outcome = report.outcome
        if isinstance(outcome, Trained):
            if outcome.export is not None:
                self.onboard.finished(outcome.export)
            self.detail = ""
            if report.update is None:  # a local round: its status tells the server (last_completed_round)
                return self._set_state("done", publish=True)
            if gated := self.edge.telemetry.reasons():  # kept on disk, unsent: re-sent once the gate opens (``_step``)
                return self._gated(gated)
            return self._send(task, report.update)
        if isinstance(outcome, Cancelled):
            log.warning("training stopped round=%d attempt=%d: %s", task.round, task.attempt, outcome.reason)
            return self._set_state("gated" if gated else "idle", publish=True)
        if isinstance(outcome, Declined):
            self._warn("declined", "round declined round=%d reason=%s", task.round, outcome.reason)
            self.detail = f"training declined: {outcome.reason}"  # the operator's monitor shows why
            return self._set_state("declined", publish=True)
        assert isinstance(outcome, Failed)
        log.error("training failed round=%d attempt=%d: %s", task.round, task.attempt, outcome.reason)
        self.edge.errors, self.detail = self.edge.errors + 1, f"training failed: {outcome.reason}"
        return self._set_state("failed", publish=True)

    def _resend(self, task: RoundTask) -> None:
        if (data := self.client.resend(task)) is not None:
            self._send(task, data)

    def _send(self, task: RoundTask, data: bytes) -> None:
        """Hand the sealed update to paho; it counts as sent once the broker acknowledged every chunk
        (``_check_upload``, from the loop: the daemon never blocks on the network). The state becomes "uploading"
        only at a step that finds that acknowledgement missing (``_step``): on a good link "done" follows within
        milliseconds, and a status replaced that soon tells no one anything but costs the agent, the broker and
        the server a signed message each (a third of an agent's statuses a round; docs/results/scale.md)."""
        self.client.send(self.edge.mqtt, task, data, self.server_time())  # signed on the server's clock (agent.clock)

    def _check_upload(self) -> None:
        upload = self.client.upload
        if self.client.check_upload(self.edge.mqtt, self.task) == "acknowledged":
            self.edge.metrics.update_sent(upload.size)
            self._set_state("done", publish=True)

    # transfers ---------------------------------------------------------------------------------------
    def _on_transfer_chunk(self, payload: bytes, kinds: frozenset[str], topic_round: int | None = None) -> None:
        outcome = self.inbox.feed(payload, kinds, topic_round, self.task)
        if outcome == "groupkey":
            # (Re)subscribing makes the broker resend the retained model chunks, now decryptable.
            self.edge.mqtt.subscribe(self.topics.model_wildcard)
            self.report.publish(force=True)
        elif outcome == "groupkey-held":  # the server resent it, our status lagging: say we hold it, and no more
            self.report.publish(force=True)  # (the chunks already opened: resubscribing would fetch them again)
        elif outcome == "key-mismatch":
            self._warn("re-enrol", "%s", self.report.waiting_for())
        elif outcome in ("model", "start", "peers"):  # what a selected agent's step may be waiting for
            self.edge.mqtt.wake()

    @property
    def group_keys(self) -> dict[str, GroupKey]:
        return self.inbox.group_keys

    @property
    def models(self) -> dict[int, NamedArrays]:
        return self.inbox.models

    # status ------------------------------------------------------------------------------------------
    def _warn(self, key: str, message: str, *args: object) -> None:
        self.edge.warn(key, message, *args)

    def _set_state(self, state: str, *, publish: bool = False) -> None:
        changed = state != self.state
        self.state = state
        if changed or publish:
            self.report.publish(force=True)
