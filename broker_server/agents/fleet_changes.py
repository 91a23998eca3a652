"""How the running server answers changes in its fleet that it did not make: an agent revoked mid-round
(``broker_server.agents.trust``), and agents that hold newer rounds than its state (``broker_server.rounds.catch_up``).
``Aggregator.fleet_changes``; each change is written durably (``broker_server.rounds.disk``) before anything is
published.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker_server.agents.publisher import ModelPublisher
from broker_server.agents.registry import AgentRegistry
from broker_server.rounds.catch_up import catch_up
from broker_server.rounds.disk import DiskWatch
from broker_server.rounds.engine import RoundEngine
from protocol.messages import AgentStatus
from protocol.mqtt import MqttClient
from protocol.topics import Topics
from protocol.transfer import Reassembler
from security.keys import Identity
from security.signing import receipt_valid

log = logging.getLogger("skyfed.server")


class FleetChanges:
    """``publish_task``: the open round's task issued again (``Aggregator``), once a revocation changed it."""

    def __init__(self, engine: RoundEngine, *, disk: DiskWatch, registry: AgentRegistry, publisher: ModelPublisher,
                 reassembler: Reassembler, mqtt: MqttClient, topics: Topics, identity: Identity,
                 publish_task: Callable[[], object], clock: Callable[[], float]) -> None:  # fmt: skip
        self.engine, self.disk, self.registry, self.publisher = engine, disk, registry, publisher
        self.reassembler, self.mqtt, self.topics, self.identity = reassembler, mqtt, topics, identity
        self.publish_task, self.clock = publish_task, clock

    def on_revoked(self, agent: str) -> None:
        """Its retained status goes (monitors stop listing it); its part in the open round ends now, and the
        round's task, issued again (same attempt and deadline), names it so that it stops."""
        self.mqtt.publish(self.topics.agent_status(agent), b"", retain=True)
        self.reassembler.drop_where(lambda m: m.sender == agent)  # its unfinished transfers hold memory for nothing
        with self.disk.writing(self.clock(), self.engine.state.durably(f"revocation of {agent}")):
            if self.engine.fleet.revoke(agent):
                rs = self.engine.round_state
                assert rs is not None
                self.publish_task()
                log.warning("round %d: revoked agent %s is no longer waited for; pending=%s", rs.round, agent,
                            ",".join(rs.pending) or "-")  # fmt: skip

    def catch_up(self) -> None:
        """Agents hold newer rounds of this run than this state: jump past them (``broker_server.rounds.catch_up``)."""
        engine, public, federation = self.engine, self.identity.public, self.topics.federation

        def proven(s: AgentStatus) -> bool:  # the server's own signature over the round the agent holds
            return receipt_valid(s.receipt, public, federation, s.run_id, s.round, s.task_version)

        held = engine.state.held_round
        jump = catch_up(self.registry.agents.values(), run_id=engine.run_id, held_round=held, version=engine.version,
                        proven=proven)  # fmt: skip
        if jump is not None:
            with self.disk.writing(self.clock(), engine.state.durably("catch-up with the fleet")):
                log.warning("%s", jump.describe(held, engine.version))
                engine.fleet.jump(jump.next_round, jump.version)
                self.publisher.publish(engine.version, engine.global_arrays)
