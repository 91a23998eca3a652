"""The edge agent daemon: wait for a signed round task, fetch the global model, train, send the delta.

One MQTT connection and one thread of control: received messages queue up and ``EdgeAgent.run``
handles them between steps, so training never blocks the network thread's keep-alives. Progress is
durable (``agent.state``): after a crash or reboot the agent resumes without skipping or repeating a
round, and re-sends its stored update when the server says it is still pending.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import paho.mqtt.client as paho
import torch

from agent.config import AgentConfig
from agent.state import ProgressStore
from agent.trainer import ClassifierTrainer, Trainer
from models.datasets import load_dataset
from models.serialization import SerializationError, dumps, loads
from models.weights import NamedArrays, delta
from models.zoo import pick_device
from protocol.messages import AgentStatus, Gate, MessageError, RoundTask
from protocol.mqtt import MqttClient, Will
from protocol.topics import Topics
from protocol.transfer import Completed, Reassembler, TransferLimits, TransferRejected
from protocol.update import UpdateMeta
from security.envelope import Opener, seal
from security.keys import GroupKey, Identity, Keyring, PublicIdentity
from security.signing import InvalidDocument, verify_document

log = logging.getLogger("skyfed.agent")

PUBLISH_TIMEOUT_S = 120.0


class EdgeAgent:
    def __init__(self, config: AgentConfig, *, trainer: Trainer | None = None) -> None:
        self.config = config
        self.id = config.agent.id
        self.topics = Topics(config.agent.federation)
        self.identity = Identity.load(config.identity_path)
        if self.identity.name != self.id:
            raise ValueError(f"{config.path}: keys.identity holds the key of {self.identity.name!r}, not {self.id!r}")
        self.server = PublicIdentity.load(config.server_key_path)
        self.keyring = Keyring()
        self.keyring.add(self.server)
        self.group_keys: dict[str, GroupKey] = {}
        self.opener = Opener(
            identity=self.identity,
            federation=self.topics.federation,
            senders=self.keyring,
            group_keys=self.group_keys,
        )
        self.reassembler = Reassembler(self.opener, TransferLimits(max_bytes=1 << 30, max_partial_per_sender=4))
        if config.training.threads > 0:
            torch.set_num_threads(config.training.threads)
        device = pick_device() if config.training.device == "auto" else torch.device(config.training.device)
        self.data = load_dataset(config.data_path)
        self.trainer = trainer or ClassifierTrainer(self.data, device=device, agent_id=self.id, seed=config.agent.seed)
        self.store = ProgressStore(config.state_dir)
        self.progress = self.store.load()
        self.models: dict[int, NamedArrays] = {}
        self.model_sha256 = ""
        self.task: RoundTask | None = None
        self.state = "starting"
        self.detail = ""
        self._last_status = 0.0
        self.mqtt = MqttClient(
            self.id,
            config.broker,
            will=Will(self.topics.agent_status(self.id), AgentStatus.offline(self.id).to_json()),
            on_connect=self._on_connect,
        )

    # main loop ---------------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        self.mqtt.subscribe(self.topics.round)
        self.mqtt.subscribe(self.topics.agent_inbox(self.id))
        self.mqtt.start()
        log.info(
            "agent started id=%s federation=%s samples=%d last_completed_round=%d",
            self.id,
            self.topics.federation,
            len(self.data),
            self.progress.last_completed_round,
        )
        try:
            while not stop.is_set():
                message = self.mqtt.poll(0.1)
                if message is not None:
                    try:
                        self._dispatch(*message)
                    except Exception:  # noqa: BLE001 - input must never take the daemon down
                        log.exception("internal error while handling topic=%s bytes=%d", message[0], len(message[1]))
                    continue
                self._step()
                self._publish_status()
        finally:
            self.state = "offline"  # a clean stop says so itself; a crash leaves it to the LWT
            last = self._publish_status(force=True)
            if last is not None:
                self.mqtt.wait_published([last], 5)
            self.mqtt.stop()

    def _on_connect(self) -> None:
        self._last_status = 0.0

    def _dispatch(self, topic: str, payload: bytes) -> None:
        if topic == self.topics.round:
            self._on_task(payload)
        elif topic == self.topics.agent_inbox(self.id):
            self._on_transfer_chunk(payload, frozenset({"groupkey"}))
        elif self.topics.model_version_of(topic) is not None and payload:
            self._on_transfer_chunk(payload, frozenset({"model"}))

    def _on_task(self, payload: bytes) -> None:
        if not payload:
            return
        try:
            body = verify_document(json.loads(payload), self.server)
            task = RoundTask.from_dict(body)
        except (InvalidDocument, MessageError, ValueError) as exc:
            log.warning("round task rejected reason=%s", getattr(exc, "reason", exc))
            return
        if task.federation != self.topics.federation:
            log.warning("round task rejected reason=wrong-federation federation=%s", task.federation)
            return
        self.task = task

    def _on_transfer_chunk(self, payload: bytes, kinds: frozenset[str]) -> None:
        try:
            completed = self.reassembler.feed(payload, topic_sender=self.server.name, kinds=kinds)
        except TransferRejected as exc:
            log.warning("transfer rejected kind=%s reason=%s", "/".join(kinds), exc.reason)
            return
        if completed is None:
            return
        if completed.manifest.kind == "groupkey":
            self._on_group_key(completed)
        else:
            self._on_model(completed)

    def _on_group_key(self, completed: Completed) -> None:
        key = GroupKey.from_bytes(bytes(completed.data))
        self.group_keys[key.key_id] = key
        log.info("group key received key_id=%s", key.key_id)
        # (Re)subscribing makes the broker resend the retained model chunks, now decryptable.
        self.mqtt.subscribe(self.topics.model_wildcard)
        self._publish_status(force=True)

    def _on_model(self, completed: Completed) -> None:
        version = completed.manifest.round
        try:
            arrays, _ = loads(completed.data)
        except SerializationError as exc:
            log.warning("model rejected version=%d reason=%s", version, exc)
            return
        self.models = {version: arrays}  # only the newest version is ever needed
        self.model_sha256 = completed.manifest.sha256.hex()
        log.info("model received version=%d bytes=%d", version, completed.manifest.size)

    # work --------------------------------------------------------------------------------------------
    def _step(self) -> None:
        task = self.task
        if task is None or self.id not in task.selected:
            return self._set_state("idle")
        done = self.progress.last_completed_round
        if task.round < done:
            return self._set_state("idle")
        if task.round == done:
            if self.id in task.pending and task.attempt > self.progress.last_sent_attempt:
                self._resend(task)
            return self._set_state("done")
        global_arrays = self.models.get(task.model_version)
        if global_arrays is None or self.model_sha256 != task.model_sha256:
            return self._set_state("waiting-model")
        self._train_and_send(task, global_arrays)
        return None

    def _train_and_send(self, task: RoundTask, global_arrays: NamedArrays) -> None:
        self._set_state("training", publish=True)
        started = time.perf_counter()
        result = self.trainer.train(global_arrays, task)
        meta = UpdateMeta(round=task.round, base_version=task.model_version, samples=result.samples, loss=result.loss)
        data = dumps(delta(result.arrays, global_arrays), metadata=meta.to_metadata())
        self.store.store_update(task.round, data)
        self.progress.last_completed_round = task.round
        self.progress.last_sent_attempt = task.attempt
        self.store.save(self.progress)
        log.info(
            "trained round=%d samples=%d loss=%.4f seconds=%.2f",
            task.round,
            result.samples,
            result.loss,
            time.perf_counter() - started,
        )
        self._send(task, data)

    def _resend(self, task: RoundTask) -> None:
        data = self.store.stored_update(task.round)
        if data is None:
            log.warning("cannot re-send round=%d: stored update missing", task.round)
            return
        self.progress.last_sent_attempt = task.attempt
        self.store.save(self.progress)
        log.info("re-sending stored update round=%d attempt=%d", task.round, task.attempt)
        self._send(task, data)

    def _send(self, task: RoundTask, data: bytes) -> None:
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
            log.info("update sent round=%d chunks=%d bytes=%d", task.round, len(chunks), sum(map(len, chunks)))
        else:
            log.warning("update for round=%d not yet acknowledged; paho keeps re-sending it", task.round)
        self._set_state("done", publish=True)

    # status ------------------------------------------------------------------------------------------
    def _set_state(self, state: str, *, publish: bool = False) -> None:
        changed = state != self.state
        self.state = state
        if changed or publish:
            self._publish_status(force=True)

    def _status(self) -> AgentStatus:
        task = self.task
        return AgentStatus(
            agent=self.id,
            state=self.state,
            round=task.round if task else 0,
            samples=len(self.data),
            version=max(self.models, default=0),
            updated_at=time.time(),
            gate=Gate(ok=True, reasons=[]),
            group_key_id=next(reversed(self.group_keys), ""),
            last_completed_round=self.progress.last_completed_round,
        )

    def _publish_status(self, *, force: bool = False) -> paho.MQTTMessageInfo | None:
        now = time.time()
        if not force and now - self._last_status < self.config.agent.status_interval_s:
            return None
        self._last_status = now
        return self.mqtt.publish(self.topics.agent_status(self.id), self._status().to_json(), retain=True)
