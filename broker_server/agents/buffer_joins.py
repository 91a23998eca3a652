"""Asynchronous rounds: idle agents that come online join the open buffer on the server's word
(``broker_server.rounds.async_rounds``). ``Aggregator.joins``; each join is written durably before the task naming
the agents is issued again and their start models are sent."""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker_server.agents.delivery import Delivery
from broker_server.agents.registry import AgentRegistry
from broker_server.rounds.accept import LateWindow
from broker_server.rounds.disk import DiskWatch
from broker_server.rounds.engine import RoundEngine

log = logging.getLogger("skyfed.server")

SETTLE_S = 2.0  # a status heard this long after an agent was asked is taken to answer the task
JOIN_INTERVAL_S = 1.0  # idle agents are asked to join at most this often: each join issues the task to every agent


class BufferJoins:
    """``key_id`` says the current group key's id (an agent holding an older one is not eligible); ``publish_task``
    issues the open round's task again (``Aggregator``)."""

    def __init__(self, engine: RoundEngine, *, disk: DiskWatch, registry: AgentRegistry, delivery: Delivery,
                 key_id: Callable[[], str], publish_task: Callable[[], object]) -> None:  # fmt: skip
        self.engine, self.disk, self.registry, self.delivery = engine, disk, registry, delivery
        self.key_id, self.publish_task = key_id, publish_task
        self.next_at = 0.0

    def busy(self, now: float, held: set[str] | frozenset[str] = frozenset()) -> set[str]:
        """Agents not to ask now: training or sending by their status, owed an update by the server's record and not
        heard from since, or with a late update ``held`` for the next buffer."""
        return self.registry.busy(now) | self.engine.buffer.unsettled(self.settled) | set(held)

    def settled(self, agent: str, window: LateWindow) -> bool:
        """Whether ``agent`` owes ``window``'s round nothing more: heard from after the round last asked it (a status
        sent before the task arrived says nothing of it) without having completed that round. One that completed it
        has its update on the way (its status can arrive first) or folded into the open buffer, which takes one
        update an agent: asked again now, its next update would be refused, so it waits for the buffer to close."""
        status, heard = self.registry.status(agent), self.registry.heard_at(agent)
        return status is not None and status.last_completed_round < window.round and \
            heard >= window.asked_at + SETTLE_S  # fmt: skip

    def poll(self, now: float) -> None:
        if now < self.next_at:
            return
        self.next_at = now + JOIN_INTERVAL_S
        engine = self.engine
        idle = engine.health.available(self.registry.eligible(self.key_id(), now), engine.next_round, now)
        if engine.config.privacy.enabled:  # only agents with budget for one more update
            idle = engine.ledger.affordable(idle)
        joined: list[str] = []
        with self.disk.writing(now, engine.state.durably("agents joining the buffer")):
            joined = engine.buffer.join(idle, self.busy(now), now)
        if not joined:
            return
        self.publish_task()
        for agent in joined:
            self.delivery.send_start(agent)
        rs = engine.round_state
        assert rs is not None
        log.info("agents joined round=%d joined=%s buffer=%d/%d", rs.round, ",".join(joined), len(rs.updates),
                 engine.rules.buffer)  # fmt: skip
