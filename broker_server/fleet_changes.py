"""How the running server answers changes in its fleet that it did not make: an agent revoked mid-round
(``broker_server.trust``), and agents that hold newer rounds than its state (``broker_server.catch_up``).
Mixed into the daemon (``broker_server.daemon.Aggregator``); each change is written durably
(``broker_server.disk``) before anything is published.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from broker_server.catch_up import catch_up
from protocol.messages import AgentStatus
from security.signing import receipt_valid

if TYPE_CHECKING:
    from broker_server.daemon import Aggregator

log = logging.getLogger("skyfed.server")


class FleetChanges:
    def _on_revoked(self: Aggregator, agent: str) -> None:
        """Its retained status goes (monitors stop listing it); its part in the open round ends now, and the
        round's task, issued again (same attempt and deadline), names it so that it stops."""
        self.mqtt.publish(self.topics.agent_status(agent), b"", retain=True)
        self.reassembler.drop_where(lambda m: m.sender == agent)  # its unfinished transfers hold memory for nothing
        with self.disk.writing(self.clock(), self.engine.durably(f"revocation of {agent}")):
            if self.engine.revoke(agent):
                rs = self.engine.round_state
                assert rs is not None
                self._publish_task()
                log.warning("round %d: revoked agent %s is no longer waited for; pending=%s", rs.round, agent,
                            ",".join(rs.pending) or "-")  # fmt: skip

    def _catch_up(self: Aggregator) -> None:
        """Agents hold newer rounds of this run than this state: jump past them (``broker_server.catch_up``)."""
        engine, public, federation = self.engine, self.identity.public, self.topics.federation

        def proven(s: AgentStatus) -> bool:  # the server's own signature over the round the agent holds
            return receipt_valid(s.receipt, public, federation, s.run_id, s.round, s.task_version)

        jump = catch_up(self.registry.agents.values(), run_id=engine.run_id, held_round=engine.held_round,
                        version=engine.version, proven=proven)  # fmt: skip
        if jump is not None:
            with self.disk.writing(self.clock(), engine.durably("catch-up with the fleet")):
                log.warning("%s", jump.describe(engine.held_round, engine.version))
                engine.jump(jump.next_round, jump.version)
                self.publisher.publish(engine.version, engine.global_arrays)
