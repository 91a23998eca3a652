"""The aggregator daemon: the I/O shell around the round engine.

It owns the MQTT connection and the timers and nothing else: chunks go to the reassembler, complete
updates to ``intake`` (``broker_server.agents.intake``: ``RoundEngine.accept``, a burst of them with one write of
the state), status messages to the registry and the group-key distributor; on
each tick the engine says whether to open, re-announce or close a round, and the shell publishes what
that produced (signed round task, sealed model, metrics, status). Every refusal ends in ``refusals``
(``broker_server.agents.refusals``): a reason in the log, the counters in ``server/status`` and the round's
``metrics.rejected``. The daemon loop itself (``protocol.daemon.MqttDaemon``) survives any exception.

What is not the round's own flow is a collaborator the daemon holds and hands what it needs: ``delivery``
(models to inboxes, retained messages healed), ``fleet_changes`` (revocations, catching up with the fleet),
``joins`` (asynchronous rounds: idle agents joining the open buffer), ``pool_rounds`` (``[pool]``), ``regional``
(``[upstream]``) and ``report`` (``server/status``, systemd).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import paho.mqtt.client as paho

from broker_server.agents.buffer_joins import BufferJoins
from broker_server.agents.delivery import Delivery
from broker_server.agents.fleet_changes import FleetChanges
from broker_server.agents.groupkeys import GroupKeyDistributor
from broker_server.agents.ignored import IgnoredAgents
from broker_server.agents.intake import UpdateIntake
from broker_server.agents.publisher import ModelPublisher
from broker_server.agents.reconnects import Reconnects
from broker_server.agents.refusals import Refusals
from broker_server.agents.registry import AgentRegistry, StatusRefused
from broker_server.agents.task_publisher import TaskPublisher
from broker_server.agents.trust import TrustKeeper
from broker_server.config import ServerConfig
from broker_server.pool import POOL, POOL_NAME_TAKEN
from broker_server.pool.pool_rounds import PoolRounds
from broker_server.pool.shared import SharedPool
from broker_server.rounds.accept import check_gates, largest_update_bytes
from broker_server.rounds.disk import DiskWatch
from broker_server.rounds.engine import RoundEngine
from broker_server.rounds.evaluation import server_evaluator
from broker_server.rounds.metrics_log import log_round, log_run_finished
from broker_server.rounds.round_task import round_task
from broker_server.upstream.handoff import UpstreamHandoff
from broker_server.upstream.upstream_rounds import UpstreamRounds
from broker_server.watch.history import RunHistory
from broker_server.watch.prometheus import ServerMetrics
from broker_server.watch.status_report import StatusReport
from flcore.update import NotForThisRound
from flcore.validation import reason_kind
from protocol.daemon import MqttDaemon
from protocol.messages import AgentStatus, RoundTask, ServerStatus
from protocol.mqtt import MqttClient, Will
from protocol.topics import Topics
from protocol.transfer import Reassembler, TransferRejected
from security.envelope import Manifest, Opener
from security.keys import GroupKey, Identity, Keyring

log = logging.getLogger("skyfed.server")


class Aggregator(MqttDaemon):
    """Runs rounds until ``server.rounds`` are done (or forever when it is 0, or with ``keep_running``); in a
    region (``upstream``), one for each root round that waits for it (``broker_server.upstream.upstream_rounds``)."""

    def __init__(self, config: ServerConfig, *, keep_running: bool = False, clock: Callable[[], float] = time.time,
                 upstream: UpstreamHandoff | None = None) -> None:  # fmt: skip
        fed = config.server.federation
        self.config = config
        self.clock = clock
        self.keep_running = keep_running
        self.topics = Topics(fed)
        self.identity = Identity.load(config.identity_path)
        keyring = Keyring.load_dir(config.enrolled_dir)
        self.opener = Opener(identity=self.identity, federation=fed, senders=keyring)
        self.engine = RoundEngine(config, replay=self.opener.replay, evaluator=server_evaluator(config))
        self.pool = SharedPool(config) if config.pool.enabled else None  # [pool]: trained as one more participant
        self.upstream = upstream
        largest = largest_update_bytes(self.engine.float_spec, self.engine.codec)
        self.reassembler = Reassembler(self.opener, config.limits.to_limits(largest))
        self.registry = AgentRegistry(keyring, config.rounds.status_timeout_s)
        super().__init__(
            MqttClient(
                f"{fed}-server",
                config.broker,
                will=Will(self.topics.server_status, ServerStatus.offline(fed).to_json()),
                on_connect=self._on_connect,
            ),
            log,
        )
        key_file = config.state_dir / "group.key"
        self.group_keys = GroupKeyDistributor(
            key_file, identity=self.identity, keyring=keyring, federation=fed, clock=clock,
            send=lambda agent, chunks: self.delivery.send_inbox(agent, chunks),  # made below: it needs the publisher
        )
        self.publisher = ModelPublisher(self.mqtt, self.topics, self.identity, self.group_keys.key, config.server.model)
        self.rejections = Counter[str]()
        self.disk = DiskWatch(lambda: self.engine.state.settled_writes)
        self.phase = "starting"
        self.ignored = IgnoredAgents(config.enrolled_dir, keyring, fed, self.rejections)
        self.tasks = TaskPublisher(self.mqtt, self.topics.round, self.identity)
        parts = {"mqtt": self.mqtt, "topics": self.topics, "identity": self.identity, "clock": clock}
        self.delivery = Delivery(self.engine, registry=self.registry, publisher=self.publisher, tasks=self.tasks,
                                 **parts)  # fmt: skip
        self.fleet_changes = FleetChanges(self.engine, disk=self.disk, registry=self.registry,
                                          publisher=self.publisher, reassembler=self.reassembler,
                                          publish_task=self._publish_task, **parts)  # fmt: skip
        self.joins = BufferJoins(self.engine, disk=self.disk, registry=self.registry, delivery=self.delivery,
                                 key_id=lambda: self.group_keys.key.key_id,
                                 publish_task=self._publish_task)  # fmt: skip
        self.trust = TrustKeeper(
            config.enrolled_dir,
            registry=self.registry,
            ignored=self.ignored,
            distributor=self.group_keys,
            on_rotated=self._on_key_rotated,
            on_enrolled=lambda: self.mqtt.subscribe(self.topics.any_federation_status_wildcard),  # retained again
            on_revoked=self.fleet_changes.on_revoked,
            rotate_every_rounds=config.keys.rotate_every_rounds,
            reserved={POOL: POOL_NAME_TAKEN} if self.pool is not None else None,  # as the start check refuses it
        )
        self.regional = None if upstream is None else UpstreamRounds(upstream, self.engine, disk=self.disk,
                                                                     publisher=self.publisher)  # fmt: skip
        self.reconnects = Reconnects()
        self.history = RunHistory(self.topics.federation)  # retained on server/history for a dashboard
        self.history.seed(config.state_dir / "metrics.jsonl")
        self.prometheus = ServerMetrics(config.metrics)  # late: it listens on a port until ``on_stop``
        self.refusals = Refusals(self.engine, registry=self.registry, counts=self.rejections,
                                 prometheus=self.prometheus, pool=self.pool is not None)  # fmt: skip
        self.intake = UpdateIntake(self.engine, disk=self.disk, refusals=self.refusals, prometheus=self.prometheus,
                                   clock=clock, waiting=self.mqtt.waiting, close=self._close)  # fmt: skip
        self.pool_rounds = None if self.pool is None else PoolRounds(self.pool, self.engine, accept=self.intake.accept,
                                                                     round_change=self._round_change,
                                                                     clock=clock)  # fmt: skip
        self.report = StatusReport(config, self.engine, registry=self.registry, group_keys=self.group_keys,
                                   disk=self.disk, rejections=self.rejections, mqtt=self.mqtt, topics=self.topics,
                                   prometheus=self.prometheus, clock=clock, phase=lambda: self.phase,
                                   errors=lambda: self.errors, connection_state=self.connection_state)  # fmt: skip

    # MqttDaemon --------------------------------------------------------------------------------------
    def subscriptions(self) -> list[str]:
        # every federation's agent status (not only ours, with no overlap: a status arrives once), and the
        # model's retained chunks read back (broker_server.agents.model_resend)
        status, updates = self.topics.any_federation_status_wildcard, self.topics.agent_update_wildcard
        return [status, updates, self.topics.round, self.topics.model_wildcard]

    def on_start(self) -> None:
        self.publisher.publish(self.engine.version, self.engine.global_arrays)
        self.mqtt.publish(self.topics.server_history, self.history.payload(), retain=True)
        if self.engine.round_state is not None:
            with self.disk.writing(self.clock(), self.engine.state.durably("round re-announcement")):
                self._announce(reannounce=True)

    def on_stop(self) -> None:
        self.prometheus.close()

    def publish_final_status(self) -> paho.MQTTMessageInfo | None:
        return self.report.publish_final()

    def systemd_status(self) -> str:
        return self.report.systemd_line()

    def progress_fields(self) -> str:
        return self.report.progress_fields()

    def finished(self) -> bool:
        return self.engine.finished and not self.keep_running and not self.engine.state.outputs_pending

    def handle(self, topic: str, payload: bytes) -> None:
        agent = self.topics.agent_of(topic)
        if agent is None or topic not in (self.topics.agent_update(agent), self.topics.agent_status(agent)):
            self.guard("update intake", self.intake.flush)  # a batch: updates, and the statuses between them
        if topic == self.topics.round:
            self.tasks.received(payload, self.clock())
            return
        if (version := self.topics.model_version_of(topic)) is not None:
            self.publisher.retained.observe(version, topic.rsplit("/", 1)[1], payload)
            return
        if (foreign := self.topics.foreign_status_of(topic)) is not None:
            self.ignored.foreign(*foreign, payload)
            return
        if agent is None:
            return
        if topic == self.topics.agent_status(agent):
            self._on_status(agent, payload)
        elif topic == self.topics.agent_update(agent):
            self._on_update_chunk(agent, payload)

    def tick(self) -> None:
        self.guard("update intake", self.intake.flush)
        self._resume(self.reconnects.due())
        for rejection in self.reassembler.expire():
            self.refusals.refuse(rejection.sender, rejection.reason)
        now = self.clock()
        self.trust.poll(now)
        if self.pool_rounds is not None:
            self.pool_rounds.poll()
        if self.disk.due(now):  # after a failed write, the next try waits (broker_server.rounds.disk)
            self._round_step(now)
        self.delivery.heal_retained(now)
        self.report.publish()

    def _round_step(self, now: float) -> None:
        """Open, re-announce or close a round as the engine decides; each a change that is undone if its
        checkpoint cannot be written, and tried again later."""
        if self.engine.state.outputs_pending:
            with self.disk.writing(now):
                self.engine.state.flush_outputs()
        self.intake.retry()
        if trained := self.engine.local.trained_news(self.registry.status):  # a local round (``local_rounds``)
            with self.disk.writing(now, self.engine.state.durably(f"{','.join(trained)} trained locally")):
                self.engine.local.trained_locally(trained)
        action = self.engine.decide(now)
        if action == "idle" and not self.engine.finished:
            self.phase = "waiting-for-agents" if self.regional is None else self.regional.phase()
            if self.regional is not None and not self.regional.may_begin(now):
                return
            self.trust.rotate_on_schedule(self.engine.next_round)
            eligible = self.registry.eligible(self.group_keys.key.key_id, now)
            held = set(self.intake.held_late)  # their late updates join the round: they do not train for it
            busy = self.joins.busy(now, held) if self.config.rounds.is_async else None  # only a buffer asks
            with self.disk.writing(now, self.engine.state.durably("round start")):
                if self.engine.begin_round(eligible, now, enrolled=self.registry.keyring.names(),
                                           busy=busy, held=bool(held)) is not None:  # fmt: skip
                    if self.regional is not None:
                        self.regional.begun()
                    self._announce(reannounce=False)
                elif self.engine.finished:  # the privacy budget ran out
                    self.phase = "finished"
                    self._publish_if_new()
                    self._log_finished()
            if self.engine.round_state is not None:  # late updates held between the rounds join it now
                held, self.intake.held_late = self.intake.held_late, {}
                self.intake.accept(*held.values())
        elif action == "close":
            self._close(now)
        elif action == "wait" and self.config.rounds.is_async:  # idle agents join the open buffer
            self.joins.poll(now)
        elif action == "reannounce":
            with self.disk.writing(now, self.engine.state.durably("round re-announcement")):
                self.engine.replace_missing(self.registry.eligible(self.group_keys.key.key_id, now), now)
                if self.engine.round_state is not None and self.engine.round_state.pending:
                    self._announce(reannounce=True)
            if self.engine.round_state is not None and not self.engine.round_state.pending:  # nobody to ask
                self._close(now, stuck=True)

    def _on_status(self, agent: str, payload: bytes) -> None:
        """An agent's signed status. One that may change the round (a training given up, or a round past the one
        held) first lets in the updates of the open batch; others leave it open while more messages wait
        (``UpdateIntake``): at 1,000 agents the statuses between uploads made nearly every update a write of its own."""
        if payload and agent not in self.registry.keyring:
            self.ignored.not_enrolled(agent)
            return
        try:
            previous, status = self.registry.update(agent, payload, self.clock())
        except StatusRefused as exc:
            self.ignored.status_refused(agent, exc.reason)
            return
        if self.group_keys.on_status(agent, previous, status) and self.engine.round_state is None:
            self.mqtt.wake()  # the agents sent the key hold it: a round may open now, not a tick later
        self.delivery.note_model_wait(agent, status)
        if status is None:
            return
        excused = status != previous and status.state in ("failed", "declined")
        if excused or self._ahead(status) or not self.mqtt.waiting():  # the last: nothing more to batch them with
            self.guard("update intake", self.intake.flush)
        if self._ahead(status):  # still, after the batch's updates (checking the fleet's receipts is O(N))
            self.fleet_changes.catch_up()
        if excused:
            self._round_change(f"{agent} excused", lambda: self.engine.fleet.gave_up(
                agent, status.round, f"reported its training {status.state}", self.clock()))  # fmt: skip

    def _ahead(self, status: AgentStatus) -> bool:
        """The status names a round of this run past the one the server holds (its state went back in time)."""
        return status.run_id == self.engine.run_id and status.round > self.engine.state.held_round

    # rounds ------------------------------------------------------------------------------------------
    def _announce(self, *, reannounce: bool, keep_deadline: bool = False) -> None:
        latest = self.regional.root_deadline(self.clock()) if self.regional is not None else None
        rs = self.engine.announce(self.clock(), keep_deadline=keep_deadline, latest=latest)
        task = self._publish_task()
        for agent in rs.pending:
            self.delivery.send_start(agent)
        self.phase = "training"
        log.info(
            "round %s round=%d attempt=%d action=%s selected=%s pending=%s probation=%s deadline_s=%.0f",
            "reannounced" if reannounce else "started",
            rs.round,
            rs.attempt,
            rs.action,
            ",".join(rs.selected),
            ",".join(rs.pending),
            ",".join(rs.probation) or "-",
            self.config.rounds.deadline_s,
        )
        if self.pool_rounds is not None:
            self.pool_rounds.start(task)
        self.report.publish(force=True)

    def _publish_task(self) -> RoundTask:
        """Sign and publish (retained) the open round's task as the engine has it now."""
        published = self.publisher.current
        assert published is not None
        task = round_task(self.engine, published, federation=self.topics.federation,
                          group_key_id=self.group_keys.key.key_id, now=self.clock())  # fmt: skip
        self.tasks.publish(task)
        return task

    def _on_update_chunk(self, agent: str, payload: bytes) -> None:
        try:
            completed = self.reassembler.feed(payload, topic_sender=agent, kinds=frozenset({"update"}),
                                              admit=self._expected_update)  # fmt: skip
        except TransferRejected as exc:
            self.refusals.refuse(exc.sender, exc.reason)
            if (whole := exc.whole_round) is not None:
                sender, why = exc.sender, f"sent an update refused whole ({reason_kind(exc.reason)})"
                gave_up = self.engine.fleet.gave_up
                self._round_change(f"{sender} excused", lambda: gave_up(sender, whole, why, self.clock()))
            return
        if completed is not None:
            self.intake.add(completed)

    def _expected_update(self, manifest: Manifest) -> None:
        """Memory for an update transfer only when the open round waits for it from its sender: an enrolled
        agent gone rogue cannot hold reassembly memory with transfers nobody asked for."""
        if self.engine.late.held_for_next_round(manifest.sender, manifest.round):
            return
        try:
            check_gates(self.engine.round_state, manifest.sender, manifest.round, self.engine.next_round,
                        self.engine.late.windows())  # fmt: skip
        except NotForThisRound as exc:
            raise TransferRejected(manifest.sender, exc.reason) from None

    def _round_change(self, what: str, change: Callable[[], bool]) -> None:
        """An agent's news changes the open round (it gave up, ``FleetEvents.gave_up``): written durably, and
        the round closed at once if nobody is left to wait for."""
        self.intake.flush()  # the updates that came before it count first
        changed = False
        with self.disk.writing(self.clock(), self.engine.state.durably(what)):
            changed = change()
        if changed and self.engine.decide(self.clock()) == "close" and self.disk.due(self.clock()):
            self._close(self.clock())

    def _on_key_rotated(self, key: GroupKey) -> None:
        """The current model again, under the new key: an agent that joins now can read it."""
        self.publisher.group_key = key
        self.publisher.publish(self.engine.version, self.engine.global_arrays)

    def _publish_if_new(self) -> None:
        """Publish the engine's model if it is not the one out: a new average, or the best model elected at
        the end of the run."""
        current = self.publisher.current
        if current is None or self.engine.version != current.version:
            self.publisher.publish(self.engine.version, self.engine.global_arrays)

    def _close(self, now: float, *, stuck: bool = False) -> None:
        published, rs = self.publisher.current, self.engine.round_state
        assert published is not None and rs is not None
        metrics = None
        with self.disk.writing(now, self.engine.state.durably(f"round {self.engine.state.held_round} close")):
            metrics = self.engine.close(now, model_wire_bytes=published.wire_bytes, stuck=stuck)
        if metrics is None:  # not written: the previous model stays in force; closed again on a later tick
            self.report.publish(force=True)
            return
        if self.regional is None:
            self._publish_if_new()
        else:  # a region: the aggregate goes to the root; the region's agents get the root's next model
            self.regional.deliver(rs, metrics)
        self.mqtt.publish(self.topics.server_metrics, metrics.to_json())
        self.history.add(metrics)
        self.mqtt.publish(self.topics.server_history, self.history.payload(), retain=True)
        self.prometheus.round_closed(metrics)
        log_round(metrics)
        late = self.engine.late.windows()  # unfinished updates for a closed round, but the late ones folded in
        self.reassembler.drop_where(lambda m: m.round <= metrics.round and not late.welcomes(m.sender, m.round))
        self.phase = "finished" if self.engine.finished else "waiting-for-agents"
        if self.engine.finished:
            self._log_finished()
        self.report.publish(force=True)
        self.mqtt.wake()  # the next round opens at once, not a tick later

    def _log_finished(self) -> None:
        e = self.engine
        log_run_finished(rounds=e.next_round - 1, version=e.version, evaluation=e.model_eval, best=e.best.record,
                         out=self.config.state_dir / "global_model.safetensors",
                         why="privacy-budget-spent" if e.budget_exhausted else "rounds-done")  # fmt: skip

    def _on_connect(self) -> None:
        self.report.last_published = 0.0  # republish status promptly after a (re)connect
        self.reconnects.connected()  # paho's thread: the loop resumes what the broker may have lost (``tick``)

    def _resume(self, due: str) -> None:
        """After a reconnect, what the broker may have lost (``broker_server.agents.reconnects``): the model and task
        at once if it lost our session, then the open round asked again of the agents it waits for."""
        if due == "reconnected" and not self.mqtt.session_present:
            self.publisher.publish(self.engine.version, self.engine.global_arrays)
            if self.tasks.payload is not None:
                self.mqtt.publish(self.topics.round, self.tasks.payload, retain=True)
        rs = self.engine.round_state
        if due == "ask-again" and rs is not None and rs.pending:
            log.warning("broker connection back mid-round: round %d asked again of %s", rs.round, ",".join(rs.pending))
            with self.disk.writing(self.clock(), self.engine.state.durably("round re-announcement")):
                self._announce(reannounce=True, keep_deadline=True)
