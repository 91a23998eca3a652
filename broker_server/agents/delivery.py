"""Getting models to agents: what an asked agent starts from, sealed to it alone on its inbox, and the
retained model and round task healed when others remove or replace them (``broker_server.agents.model_resend``
keeps the rates). ``Aggregator.delivery``: it reads the engine's open round and sends; it decides nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker_server.agents.model_resend import MODEL_STALL_S, ModelWaits
from broker_server.agents.publisher import ModelPublisher
from broker_server.agents.registry import AgentRegistry
from broker_server.agents.task_publisher import TaskPublisher
from broker_server.rounds.engine import RoundEngine
from flcore.agent_models import BUNDLE_NAME
from models.serialization import dumps
from protocol.messages import AgentStatus
from protocol.mqtt import MqttClient
from protocol.topics import Topics
from security.envelope import seal
from security.keys import Identity

log = logging.getLogger("skyfed.server")


class Delivery:
    def __init__(self, engine: RoundEngine, *, registry: AgentRegistry, publisher: ModelPublisher, tasks: TaskPublisher,
                 mqtt: MqttClient, topics: Topics, identity: Identity, clock: Callable[[], float]) -> None:  # fmt: skip
        self.engine, self.registry, self.publisher, self.tasks = engine, registry, publisher, tasks
        self.mqtt, self.topics, self.identity, self.clock = mqtt, topics, identity, clock
        self.model_waits = ModelWaits()
        self._model_republished_at = 0.0

    def note_model_wait(self, agent: str, status: AgentStatus | None) -> None:
        rs = self.engine.round_state
        waiting = status is not None and status.state == "waiting-model" and rs is not None
        asked = waiting and status.round == rs.round and agent in rs.pending  # only asked agents get a model again
        self.model_waits.note(agent, asked, self.clock())

    def heal_retained(self, now: float) -> None:
        """Put back retained messages that others removed or replaced (the round task; the model when its
        chunks read back empty or different), and send the model to asked agents that keep waiting for
        it, each on its own inbox at a bounded rate (``broker_server.agents.model_resend``)."""
        self.tasks.heal(now)
        if self.publisher.retained.damaged and now - self._model_republished_at >= MODEL_STALL_S:
            self._model_republished_at = now
            damaged = len(self.publisher.retained.damaged)
            published = self.publisher.publish(self.engine.version, self.engine.global_arrays)
            log.warning("retained model version %d lost %d chunks (cleared or replaced by another publisher); "
                        "re-published it sha256=%s", self.engine.version, damaged, published.sha256[:12])  # fmt: skip
        rs = self.engine.round_state
        for agent in self.model_waits.due(now, rs.pending if rs is not None else []):
            public = self.registry.keyring.get(agent)
            self.send_start(agent, resend=True)  # what it starts from, if not the global model: sent again
            if self.engine.needs_global(agent) and public is not None and self.publisher.current is not None:
                self.send_inbox(agent, self.publisher.seal_for(public))
            log.warning("agent %s waits for its model; sent it to its inbox again (version %d)", agent,
                        self.engine.version)  # fmt: skip

    def send_inbox(self, agent: str, chunks: list[bytearray]) -> None:
        for chunk in chunks:
            self.mqtt.publish(self.topics.agent_inbox(agent), chunk)

    def send_start(self, agent: str, *, resend: bool = False) -> None:
        """Seal what ``agent`` starts this round from to that agent alone, on its inbox: its start model when
        it does not hold it (``inbox``), and the models its trainer attends over (``peers``, FedAMN). On a
        ``resend`` (it keeps waiting for its model) a ``local`` start goes too: its own copy may be lost."""
        rs, public = self.engine.round_state, self.registry.keyring.get(agent)
        assignment = self.engine.assignments.get(agent)
        if rs is None or public is None or assignment is None:
            return
        sent_start = resend or assignment.source == "inbox"
        parts = [("start", lambda: self.engine.start_model(agent), None)] if sent_start else []
        if assignment.peers is not None:
            parts.append(("peers", lambda: self.engine.peer_bundle(agent), {BUNDLE_NAME: assignment.peers.sha256}))
        for kind, arrays, metadata in parts:
            _, chunks = seal(dumps(arrays(), metadata), sender=self.identity, federation=self.topics.federation,
                             kind=kind, round=rs.round, recipient=public)  # fmt: skip
            self.send_inbox(agent, chunks)
            rs.inbox_bytes += sum(map(len, chunks))
            log.info("%s model%s sent round=%d agent=%s chunks=%d", kind, "s" if kind == "peers" else "", rs.round,
                     agent, len(chunks))  # fmt: skip
