"""The edge agent daemon: wait for a signed round task, fetch the global model, train, send the delta.

One MQTT connection and one thread of control (``protocol.daemon.MqttDaemon``): received messages
queue up and are handled between steps, so training never blocks the network thread's keep-alives.
Only the newest signed task counts: an older (round, attempt) of the same server run, a task past its
``expires_at``, or a task from another federation is ignored, and the newest task is kept on disk, so a
replayed old task cannot stall the agent even after a restart. Progress is durable (``agent.state``):
after a crash or reboot the agent resumes without skipping or repeating a round, and re-sends a stored
update the broker never acknowledged, or that the server lists as still pending in a later attempt.
A task may tell this agent to start from another model than the global one (model swapping): its own
last model (on disk) or one sealed to it alone; the task names it by fingerprint, and only that is used.
The trainer (``agent.trainer.build_trainer``) says why it cannot train a task's model (its gate shows it).
"""

from __future__ import annotations

import logging
import time

import paho.mqtt.client as paho
import torch

from agent.config import AgentConfig
from agent.onboard import OnboardModel
from agent.start_models import StartModelRefused, StartModels
from agent.state import AgentProgress, ProgressStore
from agent.trainer import Trainer, build_trainer, encode_update
from agent.waiting import waiting_for
from common.untrusted_json import UntrustedJsonError, parse_untrusted_json
from models.serialization import SerializationError, loads
from models.weights import NamedArrays, advanced, delta
from models.zoo import pick_device
from protocol.daemon import MqttDaemon, Throttle
from protocol.messages import MAX_JSON_BYTES, AgentStart, AgentStatus, Gate, MessageError, RoundTask
from protocol.mqtt import MqttClient, Will
from protocol.topics import Topics
from protocol.transfer import Completed, Reassembler, TransferLimits, TransferRejected
from security.envelope import Opener, seal
from security.keys import GroupKey, Identity, Keyring, PublicIdentity
from security.signing import InvalidDocument, signed_payload, verify_document

GROUP_KEYS_KEPT = 3  # after a rotation the previous key still opens the model until its re-publication
log = logging.getLogger("skyfed.agent")
STUCK_LOG_S = 60.0  # connected this long without the group key: say why in the agent's own log

PUBLISH_TIMEOUT_S = 120.0
MODEL_LIMITS = TransferLimits(
    max_bytes=1 << 30, max_partial_per_sender=4, max_pending_bytes_per_sender=2 << 30, max_pending_bytes=2 << 30
)


class EdgeAgent(MqttDaemon):
    def __init__(self, config: AgentConfig, *, trainer: Trainer | None = None) -> None:
        self.config = config
        self.id = config.agent.id
        self.topics = Topics(config.agent.federation)
        self.identity = Identity.load(config.identity_path)
        if self.identity.name != self.id:
            raise ValueError(f"{config.path}: keys.identity holds the key of {self.identity.name!r}, not {self.id!r}")
        self.server = PublicIdentity.load(config.server_key_path)
        self.group_keys: dict[str, GroupKey] = {}
        self.opener = Opener(
            identity=self.identity,
            federation=self.topics.federation,
            senders=Keyring([self.server]),
            group_keys=self.group_keys,
        )
        self.reassembler = Reassembler(self.opener, MODEL_LIMITS)
        if config.training.threads > 0:
            torch.set_num_threads(config.training.threads)
        device = pick_device() if config.training.device == "auto" else torch.device(config.training.device)
        self.trainer = trainer or build_trainer(config, device)
        self.budget = self.trainer.budget
        self.refusal = ""  # why this agent cannot train the federation's model (its gate says so)
        self.failed: tuple[int, int] = (0, 0)  # (round, attempt) whose training raised
        self.onboard = OnboardModel(config.state_dir, config.training.onnx)
        self.store = ProgressStore(config.state_dir)
        self.progress = self.store.load()
        self.models: dict[int, NamedArrays] = {}
        self.model_sha256 = ""
        self.start_models = StartModels(self.store)
        self.task: RoundTask | None = None
        self.state = "starting"
        self.detail = ""
        self._key_mismatch = False
        self._stuck_since: float | None = None
        self._said_stuck = False
        self._last_status = 0.0
        self._log = Throttle(10.0)
        offline = signed_payload(AgentStatus.offline(self.id).to_dict(), self.identity)
        super().__init__(
            MqttClient(
                self.id,
                config.broker,
                will=Will(self.topics.agent_status(self.id), offline),
                on_connect=self._on_connect,
            ),
            log,
        )
        stored = self.store.load_task()
        if stored is not None:
            self._consider_task(stored, persist=False)

    # MqttDaemon --------------------------------------------------------------------------------------
    def subscriptions(self) -> list[str]:
        return [self.topics.round, self.topics.agent_inbox(self.id)]

    def on_start(self) -> None:
        log.info(
            "agent started id=%s federation=%s samples=%d last_completed_round=%d",
            self.id,
            self.topics.federation,
            self.trainer.samples,
            self.progress.last_completed_round,
        )

    def handle(self, topic: str, payload: bytes) -> None:
        if topic == self.topics.round:
            self._on_task(payload)
        elif topic == self.topics.agent_inbox(self.id):
            self._on_transfer_chunk(payload, frozenset({"groupkey", "start"}))
        elif (version := self.topics.model_version_of(topic)) is not None and payload:
            self._on_transfer_chunk(payload, frozenset({"model"}), version)

    def tick(self) -> None:
        self._step()
        self._say_if_stuck()
        self._publish_status()

    def _say_if_stuck(self) -> None:
        """Someone watching this device's journal learns, once, why it never trains (not only the server)."""
        if self.group_keys or not self.mqtt.connected.is_set():
            self._stuck_since = None
            return
        now = time.monotonic()
        self._stuck_since = self._stuck_since or now
        if now - self._stuck_since >= STUCK_LOG_S and not self._said_stuck:
            self._said_stuck = True
            log.warning("no group key after %.0f s: %s", now - self._stuck_since, self._waiting_for())

    def publish_final_status(self) -> paho.MQTTMessageInfo | None:
        self.state = "offline"  # a clean stop says so itself; a crash leaves it to the LWT
        return self._publish_status(force=True)

    def _on_connect(self) -> None:
        self._last_status = 0.0

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
            task = RoundTask.from_dict(verify_document(document, self.server))
        except (InvalidDocument, MessageError) as exc:
            self._warn("task-invalid", "round task rejected reason=%s", getattr(exc, "reason", exc))
            return
        if task.federation != self.topics.federation:
            self._warn("task-federation", "round task rejected reason=wrong-federation federation=%s", task.federation)
            return
        held = self.task
        if held is not None and held != task and not task.is_newer_than(held):
            self._warn(
                "task-stale", "round task ignored reason=older-than-held round=%d attempt=%d", task.round, task.attempt
            )
            return
        if persist and task.expired(time.time()):
            self.detail = "the newest round task had expired on arrival: check this device's clock"
            self._warn("task-expired", "round task ignored reason=expired round=%d", task.round)
            return
        self.detail = ""
        if task.run_id != self.progress.run_id:
            log.info(
                "new server run run_id=%s (was %s): progress starts over", task.run_id, self.progress.run_id or "-"
            )
            self.progress = AgentProgress(run_id=task.run_id)
            self.store.save(self.progress)
        self.task = task
        if persist:
            self.store.save_task(document)  # type: ignore[arg-type]
        self.onboard.update(task, self.models)

    # transfers ---------------------------------------------------------------------------------------
    def _on_transfer_chunk(self, payload: bytes, kinds: frozenset[str], topic_round: int | None = None) -> None:
        try:
            completed = self.reassembler.feed(
                payload, topic_sender=self.server.name, kinds=kinds, topic_round=topic_round
            )
        except TransferRejected as exc:
            if "groupkey" in kinds and exc.reason == "bad-chunk":  # sealed to a key this agent no longer has
                self._key_mismatch = True
                self._warn("re-enrol", "%s", self._waiting_for())
            else:
                self._warn(f"transfer-{exc.reason}", "transfer rejected kind=%s reason=%s", "/".join(kinds), exc.reason)
            return
        if completed is None:
            return
        if completed.manifest.kind == "groupkey":
            self._on_group_key(completed)
        elif completed.manifest.kind == "start":
            self._on_start_model(completed)
        else:
            self._on_model(completed)

    def _on_group_key(self, completed: Completed) -> None:
        key = GroupKey.from_bytes(bytes(completed.data))
        self.group_keys.pop(key.key_id, None)
        self.group_keys[key.key_id] = key  # the newest last: the status reports it
        while len(self.group_keys) > GROUP_KEYS_KEPT:
            del self.group_keys[next(iter(self.group_keys))]
        self._key_mismatch = False
        log.info("group key received key_id=%s", key.key_id)
        # (Re)subscribing makes the broker resend the retained model chunks, now decryptable.
        self.mqtt.subscribe(self.topics.model_wildcard)
        self._publish_status(force=True)

    def _on_model(self, completed: Completed) -> None:
        """Keep the newest model, or the one the current task names (a reset server starts again at 1)."""
        version = completed.manifest.round
        wanted = self.task.model_version if self.task is not None else None
        if version < max(self.models, default=0) and version != wanted:
            self._warn("model-older", "model ignored version=%d reason=older-than-held", version)
            return
        try:
            arrays, _ = loads(completed.data)
        except SerializationError as exc:
            log.warning("model rejected version=%d reason=%s", version, exc)
            return
        self.models = {version: arrays}  # only the newest version is ever needed
        self.model_sha256 = completed.manifest.sha256.hex()
        log.info("model received version=%d bytes=%d", version, completed.manifest.size)
        self.onboard.update(self.task, self.models)

    def _on_start_model(self, completed: Completed) -> None:
        """A model sealed to this agent alone (a swap partner's, say), kept until a task names it."""
        current = self.task.round if self.task is not None else 0
        try:
            sha256 = self.start_models.receive(completed.data, completed.manifest.round, current)
        except StartModelRefused as exc:
            self._warn(f"start-{exc.reason}", "start model ignored round=%d reason=%s", completed.manifest.round, exc)
            return
        log.info("start model received round=%d sha256=%s", completed.manifest.round, sha256[:12])

    def _start_model(self, task: RoundTask, start: AgentStart) -> NamedArrays | None:
        """The model this round starts from, if this agent has it (the global one, or by fingerprint)."""
        if start.source == "global":
            arrays = self.models.get(task.model_version)
            return arrays if arrays is not None and self.model_sha256 == task.model_sha256 else None
        return self.start_models.find(start.sha256)

    # work --------------------------------------------------------------------------------------------
    def _step(self) -> None:
        task = self.task
        if task is not None and (refusal := self.trainer.refusal(task)) != self.refusal:
            self.refusal = refusal
            if refusal:
                log.warning("cannot train this federation's model: %s", refusal)
            self._publish_status(force=True)
        if task is None or self.id not in task.selected or task.expired(time.time()) or self.refusal:
            return self._set_state("idle")
        done = self.progress.last_completed_round
        if task.round < done:
            return self._set_state("idle")
        if task.round == done:
            p = self.progress
            unsent = p.sent_round < done or (p.sent_round == done and task.attempt > p.sent_attempt)
            if self.id in task.pending and unsent:
                self._resend(task)
            return self._set_state("done")
        if self.budget is not None and (refusal := self.budget.refusal(task, self.id)):
            self._warn("privacy", "round declined round=%d reason=%s", task.round, refusal)
            return self._set_state("declined")
        if self.failed == (task.round, task.attempt):
            return None  # training failed on this attempt; the server's re-announcement is the next try
        start = task.start_of(self.id)
        base = self._start_model(task, start)
        if base is None:
            return self._set_state("waiting-model")
        self._train_and_send(task, base, start)
        return None

    def _train_and_send(self, task: RoundTask, base: NamedArrays, start: AgentStart) -> None:
        self._set_state("training", publish=True)
        started = time.perf_counter()
        try:
            result = self.trainer.train(base, task)
        except Exception as exc:  # a trainer bug or bad data must not stop the daemon or retry in a loop
            log.exception("training failed round=%d attempt=%d: %s", task.round, task.attempt, exc)
            self.failed, self.errors, self.detail = (
                (task.round, task.attempt),
                self.errors + 1,
                f"training failed: {exc}",
            )
            return self._set_state("failed", publish=True)
        change = delta(result.arrays, base)
        data = encode_update(task, change, result, base_sha256="" if start.source == "global" else start.sha256,
                             local_delta=self.budget.policy.delta if self.budget is not None else None)  # fmt: skip
        self.store.store_update(task.round, data)
        if task.action != "average":  # the server keeps this agent's model: so does the agent, bit for bit
            self.start_models.keep("local", advanced(base, change), task.round)
        self.progress.last_completed_round = task.round
        self.store.save(self.progress)
        log.info(
            "trained round=%d start=%s action=%s work=%g samples=%d weight=%d loss=%.4f seconds=%.2f",
            task.round,
            start.source,
            task.action,
            task.train_of(self.id).work,
            result.samples,
            result.weight or result.samples,
            result.loss,
            time.perf_counter() - started,
        )
        self._send(task, data)

    def _resend(self, task: RoundTask) -> None:
        data = self.store.stored_update(task.round)
        if data is None:
            self._warn("resend-missing", "cannot re-send round=%d: stored update missing", task.round)
            return
        log.info("re-sending stored update round=%d attempt=%d", task.round, task.attempt)
        self._send(task, data)

    def _send(self, task: RoundTask, data: bytes) -> None:
        """Seal and publish; the update counts as sent only once the broker acknowledged every chunk."""
        self._set_state("uploading", publish=True)
        _, chunks = seal(
            data,
            sender=self.identity,
            federation=self.topics.federation,
            kind="update",
            round=task.round,
            recipient=self.server,
        )
        infos = self.mqtt.publish_all((self.topics.agent_update(self.id), c) for c in chunks)
        if self.mqtt.wait_published(infos, PUBLISH_TIMEOUT_S):
            self.progress.sent_round, self.progress.sent_attempt = task.round, task.attempt
            self.store.save(self.progress)
            log.info("update sent round=%d chunks=%d bytes=%d", task.round, len(chunks), sum(map(len, chunks)))
        else:
            log.warning("update for round=%d not yet acknowledged; paho keeps re-sending it", task.round)
        self._set_state("done", publish=True)

    # status ------------------------------------------------------------------------------------------
    def _waiting_for(self) -> str:
        return waiting_for(agent=self.id, topics=self.topics, key_mismatch=self._key_mismatch,
                           has_group_key=bool(self.group_keys), task=self.task, state=self.state)  # fmt: skip

    def _warn(self, key: str, message: str, *args: object) -> None:
        held = self._log.allow(key)
        if held is not None:
            log.warning(message + (" held_back=%d" if held else ""), *args, *((held,) if held else ()))

    def _set_state(self, state: str, *, publish: bool = False) -> None:
        changed = state != self.state
        self.state = state
        if changed or publish:
            self._publish_status(force=True)

    def _status(self) -> AgentStatus:
        task = self.task
        refusal = self.budget.refusal(None, self.id) if self.budget is not None else ""
        gate_reasons = [r for r in (refusal, self.refusal) if r]
        state, detail = self.connection_state(self.state, self.detail or self._waiting_for())
        return AgentStatus(
            agent=self.id,
            state=state,
            round=task.round if task else 0,
            samples=self.trainer.samples,
            version=max(self.models, default=0),
            updated_at=time.time(),
            gate=Gate(ok=not gate_reasons, reasons=gate_reasons),
            group_key_id=next(reversed(self.group_keys), ""),
            last_completed_round=self.progress.last_completed_round,
            detail=detail,
            errors=self.errors,
            start=task.start_of(self.id).source if task and self.id in task.selected else "",
            privacy=self.budget.summary() if self.budget is not None else {},
        )

    def _publish_status(self, *, force: bool = False) -> paho.MQTTMessageInfo | None:
        now = time.time()
        if not force and now - self._last_status < self.config.agent.status_interval_s:
            return None
        self._last_status = now
        payload = signed_payload(self._status().to_dict(), self.identity)  # the server selects on signed status only
        return self.mqtt.publish(self.topics.agent_status(self.id), payload, retain=True)
