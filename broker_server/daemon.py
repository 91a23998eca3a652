"""The aggregator daemon: one MQTT connection, one thread of control, state that survives restarts.

Messages from paho's network thread queue up in ``MqttClient.inbox``; ``Aggregator.run`` drains them
and drives the round engine, so no locks are needed and the network thread never blocks on crypto or
arithmetic. Every bad input ends in ``_reject`` (a reason in the log, the counters and the round's
metrics) and never reaches the global model.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import torch

from broker_server.checkpoint import Checkpoint, CheckpointStore
from broker_server.config import ServerConfig
from broker_server.rounds import RoundState, decide, select_agents
from broker_server.strategies import AcceptedUpdate, build_strategy
from broker_server.validation import UpdateRejected, validate_update
from models.datasets import load_dataset
from models.serialization import dumps, float32_region, save_file
from models.training import evaluate
from models.weights import flatten, float_part, load_arrays, to_arrays, unflatten
from models.zoo import build_model, pick_device
from protocol.files import atomic_write
from protocol.messages import (
    AgentStatus,
    MessageError,
    Rejection,
    RoundMetrics,
    RoundTask,
    ServerStatus,
)
from protocol.mqtt import MqttClient, Will
from protocol.topics import Topics
from protocol.transfer import Completed, Reassembler, TransferRejected
from security.envelope import Opener, seal
from security.keys import GroupKey, Identity, Keyring
from security.signing import sign_document

log = logging.getLogger("skyfed.server")

MAX_REJECTIONS_LISTED = 200
GROUP_KEY_RESEND_S = 15.0


class Aggregator:
    """Runs rounds until ``server.rounds`` are done (or forever when it is 0)."""

    def __init__(self, config: ServerConfig, *, clock=time.time) -> None:  # noqa: ANN001
        self.config = config
        self.clock = clock
        fed = config.server.federation
        self.topics = Topics(fed)
        self.identity = Identity.load(config.identity_path)
        self.keyring = Keyring.load_dir(config.enrolled_dir)
        self.group_key = self._load_group_key(config.state_dir / "group.key")
        self.opener = Opener(identity=self.identity, federation=fed, senders=self.keyring)
        self.reassembler = Reassembler(self.opener, config.limits.to_limits())
        self.strategy = build_strategy(config.strategy.name, weighting=config.strategy.weighting)
        self.store = CheckpointStore(config.state_dir / "checkpoint")
        self.device = pick_device()
        self.model = build_model(config.server.model, num_classes=config.server.num_classes)
        eval_path = config.eval_path
        self.eval_data = load_dataset(eval_path) if eval_path is not None else None
        self.agents: dict[str, AgentStatus] = {}
        self.key_sent_at: dict[str, float] = {}
        self.rejections = Counter[str]()
        self.orphan_rejections: list[dict[str, str]] = []
        self.model_chunks = 0
        self.model_sha256 = ""
        self.model_wire_bytes = 0
        self.phase = "starting"
        self._last_status = 0.0
        self._restore()
        self.mqtt = MqttClient(
            f"{fed}-server",
            config.broker,
            will=Will(self.topics.server_status, ServerStatus.offline(fed).to_json()),
            on_connect=self._on_connect,
        )

    # state -------------------------------------------------------------------------------------------
    def _load_group_key(self, path: Path) -> GroupKey:
        if path.exists():
            return GroupKey.from_bytes(path.read_bytes())
        key = GroupKey.generate()
        atomic_write(path, key.to_bytes(), mode=0o600)
        return key

    def _restore(self) -> None:
        checkpoint = self.store.load()
        if checkpoint is None:
            torch.manual_seed(self.config.server.seed)
            initial = build_model(self.config.server.model, num_classes=self.config.server.num_classes)
            self.global_arrays = to_arrays(initial)
            self.version, self.next_round, self.round_state = 1, 1, None
            self._index_model()
            self._checkpoint()
            log.info("server initialised model=%s version=1", self.config.server.model)
            return
        self.global_arrays = checkpoint.global_arrays
        self.version, self.next_round = checkpoint.model_version, checkpoint.next_round
        self.round_state = checkpoint.round_state
        self._index_model()
        if self.round_state is not None and checkpoint.strategy_state is not None:
            self.strategy.restore(self.global_vector, checkpoint.strategy_state)
        log.info(
            "server resumed version=%d next_round=%d in_round=%s accepted=%s",
            self.version,
            self.next_round,
            self.round_state.round if self.round_state else None,
            self.round_state.accepted if self.round_state else [],
        )

    def _index_model(self) -> None:
        floats = {k: v.astype(np.float32) for k, v in float_part(self.global_arrays).items()}
        _, self.float_spec, _ = float32_region(dumps(floats))
        self.global_vector = flatten(floats, self.float_spec)

    def _checkpoint(self) -> None:
        in_round = self.round_state is not None
        self.store.save(
            Checkpoint(
                next_round=self.next_round,
                model_version=self.version,
                global_arrays=self.global_arrays,
                round_state=self.round_state,
                strategy_state=self.strategy.state() if in_round else None,
            )
        )

    @property
    def finished(self) -> bool:
        limit = self.config.server.rounds
        return limit > 0 and self.next_round > limit and self.round_state is None

    # main loop ---------------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None, *, exit_when_finished: bool = True) -> None:
        stop = stop or threading.Event()
        self.mqtt.subscribe(self.topics.agent_status_wildcard)
        self.mqtt.subscribe(self.topics.agent_update_wildcard)
        self.mqtt.start()
        self._publish_model(previous=None)
        if self.round_state is not None:
            self._announce(reannounce=True)
        try:
            while not stop.is_set():
                message = self.mqtt.poll(0.1)
                if message is not None:
                    self._dispatch_guarded(*message)
                self._tick()
                if self.finished and exit_when_finished:
                    break
        finally:
            last = self._publish_status(force=True, state="finished" if self.finished else "stopped")
            if last is not None:
                MqttClient.wait_published([last], 5)
            self.mqtt.stop()

    def _on_connect(self) -> None:
        self._last_status = 0.0  # republish status promptly after a (re)connect

    def _dispatch_guarded(self, topic: str, payload: bytes) -> None:
        """Input must never take the daemon down: an unexpected error is logged and counted, then we go on."""
        try:
            self._dispatch(topic, payload)
        except Exception:  # noqa: BLE001 - last line of defence for a long-running daemon
            log.exception("internal error while handling topic=%s bytes=%d", topic, len(payload))
            self._reject(self.topics.agent_of(topic) or "?", "internal-error")

    def _dispatch(self, topic: str, payload: bytes) -> None:
        agent = self.topics.agent_of(topic)
        if agent is None:
            return
        if topic == self.topics.agent_status(agent):
            self._on_agent_status(agent, payload)
        elif topic == self.topics.agent_update(agent):
            self._on_update_chunk(agent, payload)

    def _tick(self) -> None:
        for rejection in self.reassembler.expire():
            self._reject(rejection.sender, rejection.reason)
        now = self.clock()
        if self.round_state is None:
            if not self.finished:
                self._maybe_start_round(now)
        else:
            action = decide(self.round_state, self.config.rounds, now)
            if action == "close":
                self._close_round(now)
            elif action == "reannounce":
                self._announce(reannounce=True)
        self._publish_status()

    # agents ------------------------------------------------------------------------------------------
    def _on_agent_status(self, agent: str, payload: bytes) -> None:
        if agent not in self.keyring:
            return
        if not payload:
            self.agents.pop(agent, None)
            return
        try:
            status = AgentStatus.from_json(payload)
        except MessageError as exc:
            log.warning("bad status agent=%s error=%s", agent, exc)
            return
        previous = self.agents.get(agent)
        if previous is None or previous.state == "offline" or previous.group_key_id == self.group_key.key_id:
            self.key_sent_at.pop(agent, None)  # (re)started or lost its key: send at once, not after the throttle
        self.agents[agent] = status
        if status.state != "offline" and status.group_key_id != self.group_key.key_id:
            self._send_group_key(agent)

    def _send_group_key(self, agent: str) -> None:
        now = self.clock()
        if now - self.key_sent_at.get(agent, 0.0) < GROUP_KEY_RESEND_S:
            return
        public = self.keyring.get(agent)
        assert public is not None
        _, chunks = seal(
            self.group_key.to_bytes(),
            sender=self.identity,
            federation=self.topics.federation,
            kind="groupkey",
            round=0,
            recipient=public,
        )
        for chunk in chunks:
            self.mqtt.publish(self.topics.agent_inbox(agent), chunk)
        self.key_sent_at[agent] = now
        log.info("group key sent agent=%s key_id=%s", agent, self.group_key.key_id)

    def _eligible(self) -> list[str]:
        return sorted(
            a
            for a, s in self.agents.items()
            if s.state != "offline" and s.gate.ok and s.group_key_id == self.group_key.key_id
        )

    # rounds ------------------------------------------------------------------------------------------
    def _maybe_start_round(self, now: float) -> None:
        eligible = self._eligible()
        self.phase = "waiting-for-agents"
        if len(eligible) < self.config.rounds.min_agents:
            return
        number = self.next_round
        selected = select_agents(eligible, self.config.rounds, seed=self.config.server.seed * 100_003 + number)
        self.round_state = RoundState(round=number, attempt=0, selected=selected, deadline=0.0, started_at=now)
        self.round_state.rejected.extend(self.orphan_rejections)
        self.orphan_rejections.clear()
        self.strategy.begin(self.global_vector)
        self._announce(reannounce=False)
        self._checkpoint()

    def _announce(self, *, reannounce: bool) -> None:
        rs = self.round_state
        assert rs is not None
        rs.attempt += 1
        rs.deadline = self.clock() + self.config.rounds.deadline_s
        task = RoundTask(
            federation=self.topics.federation,
            round=rs.round,
            attempt=rs.attempt,
            strategy=self.strategy.name,
            model=self.config.server.model,
            num_classes=self.config.server.num_classes,
            model_version=self.version,
            model_sha256=self.model_sha256,
            model_chunks=self.model_chunks,
            group_key_id=self.group_key.key_id,
            selected=rs.selected,
            pending=rs.pending,
            deadline=rs.deadline,
            issued_at=self.clock(),
            train=self.config.training,
        )
        document = sign_document(task.to_dict(), self.identity)
        self.mqtt.publish(self.topics.round, json.dumps(document, separators=(",", ":")).encode(), retain=True)
        self.phase = "training"
        log.info(
            "round %s round=%d attempt=%d selected=%s pending=%s deadline_s=%.0f",
            "reannounced" if reannounce else "started",
            rs.round,
            rs.attempt,
            ",".join(rs.selected),
            ",".join(rs.pending),
            self.config.rounds.deadline_s,
        )
        self._publish_status(force=True)

    def _on_update_chunk(self, agent: str, payload: bytes) -> None:
        try:
            completed = self.reassembler.feed(payload, topic_sender=agent, kinds=frozenset({"update"}))
        except TransferRejected as exc:
            self._reject(exc.sender, exc.reason)
            return
        if completed is not None:
            self._on_update(completed)

    def _on_update(self, completed: Completed) -> None:
        manifest = completed.manifest
        agent, rs = manifest.sender, self.round_state
        if rs is None:
            return self._reject(agent, "no-round-open")
        if manifest.round != rs.round:
            return self._reject(agent, f"wrong-round: transfer for round {manifest.round}, current is {rs.round}")
        if agent not in rs.selected:
            return self._reject(agent, "not-selected")
        if agent in rs.accepted:
            return self._reject(agent, "duplicate")
        try:
            update = validate_update(
                completed.data,
                expected_spec=self.float_spec,
                round_number=rs.round,
                model_version=self.version,
                max_norm=self.config.strategy.max_update_norm,
            )
        except UpdateRejected as exc:
            return self._reject(agent, exc.reason)
        self.strategy.accumulate(
            AcceptedUpdate(agent=agent, delta=update.delta, samples=update.meta.samples, loss=update.meta.loss)
        )
        rs.accepted.append(agent)
        rs.bytes_up += completed.wire_bytes
        self._checkpoint()
        log.info(
            "update accepted round=%d agent=%s samples=%d loss=%.4f norm=%.4g accepted=%d/%d",
            rs.round,
            agent,
            update.meta.samples,
            update.meta.loss,
            update.norm,
            len(rs.accepted),
            len(rs.selected),
        )
        self._publish_status(force=True)
        return None

    def _reject(self, agent: str, reason: str) -> None:
        self.rejections[reason.split(":")[0]] += 1
        log.warning("rejected agent=%s reason=%s", agent, reason)
        # Outside a round, rejections wait for the next round's metrics.
        target = self.round_state.rejected if self.round_state is not None else self.orphan_rejections
        if len(target) < MAX_REJECTIONS_LISTED:
            target.append(Rejection(agent=agent, reason=reason).to_dict())

    def _close_round(self, now: float) -> None:
        rs = self.round_state
        assert rs is not None
        started = time.perf_counter()
        result = self.strategy.finalize()
        aggregate_s = time.perf_counter() - started
        new_floats = unflatten(result.global_vector, self.float_spec)
        arrays = {
            name: new_floats[name].astype(value.dtype, copy=False) if name in new_floats else value
            for name, value in self.global_arrays.items()
        }
        previous = (self.version, self.model_chunks)
        self.global_arrays, self.version = arrays, self.version + 1
        self._index_model()
        evaluation = self._evaluate()
        self._publish_model(previous=previous)
        metrics = RoundMetrics(
            round=rs.round,
            strategy=self.strategy.name,
            participants=rs.selected,
            accepted=rs.accepted,
            rejected=[Rejection.from_dict(r) for r in rs.rejected],
            duration_s=round(now - rs.started_at, 3),
            aggregate_s=round(aggregate_s, 6),
            bytes_up=rs.bytes_up,
            bytes_down=self.model_wire_bytes * len(rs.selected),
            eval=evaluation,
            model_version=self.version,
            finished_at=now,
        )
        self.round_state, self.next_round = None, rs.round + 1
        self._checkpoint()
        save_file(self.config.state_dir / "global_model.safetensors", self.global_arrays)
        with open(self.config.state_dir / "metrics.jsonl", "ab") as handle:
            handle.write(metrics.to_json() + b"\n")
        self.mqtt.publish(self.topics.server_metrics, metrics.to_json())
        log.info(
            "round closed round=%d accepted=%d/%d rejected=%d accuracy=%s loss=%s aggregate_ms=%.2f version=%d",
            rs.round,
            len(rs.accepted),
            len(rs.selected),
            len(rs.rejected),
            evaluation.get("accuracy"),
            evaluation.get("loss"),
            aggregate_s * 1e3,
            self.version,
        )
        self.phase = "finished" if self.finished else "waiting-for-agents"
        self._publish_status(force=True)

    def _evaluate(self) -> dict[str, float]:
        if self.eval_data is None:
            return {}
        load_arrays(self.model, self.global_arrays)
        return {k: round(v, 6) for k, v in evaluate(self.model, self.eval_data, self.device).items()}

    # publishing --------------------------------------------------------------------------------------
    def _publish_model(self, previous: tuple[int, int] | None) -> None:
        data = dumps(self.global_arrays, metadata={"model": self.config.server.model, "version": str(self.version)})
        manifest, chunks = seal(
            data,
            sender=self.identity,
            federation=self.topics.federation,
            kind="model",
            round=self.version,
            group_key=self.group_key,
        )
        for index, chunk in enumerate(chunks):
            self.mqtt.publish(self.topics.model_chunk(self.version, index), chunk, retain=True)
        if previous is not None:
            old_version, old_chunks = previous
            for index in range(old_chunks):
                self.mqtt.publish(self.topics.model_chunk(old_version, index), b"", retain=True)
        self.model_chunks = len(chunks)
        self.model_sha256 = manifest.sha256.hex()  # group-sealed, so the manifest carries the plaintext's SHA-256
        self.model_wire_bytes = sum(len(c) for c in chunks)

    def _status_json(self, state: str | None = None) -> bytes:
        rs = self.round_state
        return ServerStatus(
            state=state or ("finished" if self.finished else "running"),
            federation=self.topics.federation,
            round=rs.round if rs is not None else self.next_round - 1,
            phase=self.phase,
            strategy=self.strategy.name,
            model_version=self.version,
            agents_online=sum(s.state != "offline" for s in self.agents.values()),
            updated_at=self.clock(),
            detail=", ".join(f"{k}={v}" for k, v in sorted(self.rejections.items())),
        ).to_json()

    def _publish_status(self, *, force: bool = False, state: str | None = None) -> paho.MQTTMessageInfo | None:
        now = self.clock()
        if not force and now - self._last_status < self.config.server.status_interval_s:
            return None
        self._last_status = now
        return self.mqtt.publish(self.topics.server_status, self._status_json(state), retain=True)
