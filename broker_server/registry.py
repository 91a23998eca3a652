"""The server's view of its agents, from their retained status messages: who is online and eligible.

Only enrolled agents are tracked (a status from anyone else is ignored). Status is public JSON that
anyone with publish rights can forge, so it is used only to decide whom to *ask*; what an agent *sends*
is authenticated separately (``security.envelope``).
"""

from __future__ import annotations

import logging

from protocol.messages import AgentStatus, MessageError
from security.keys import Keyring

log = logging.getLogger("skyfed.server")


class AgentRegistry:
    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self.agents: dict[str, AgentStatus] = {}

    def update(self, agent: str, payload: bytes) -> tuple[AgentStatus | None, AgentStatus | None]:
        """Fold in one status message; return ``(previous, current)`` (current None if cleared or bad)."""
        if agent not in self.keyring:
            return None, None
        previous = self.agents.get(agent)
        if not payload:
            self.agents.pop(agent, None)
            return previous, None
        try:
            status = AgentStatus.from_json(payload)
        except MessageError as exc:
            log.warning("bad status agent=%s error=%s", agent, exc)
            return previous, None
        self.agents[agent] = status
        return previous, status

    def eligible(self, group_key_id: str) -> list[str]:
        """Online agents whose gate is open and who hold the current group key."""
        return sorted(
            a for a, s in self.agents.items() if s.state != "offline" and s.gate.ok and s.group_key_id == group_key_id
        )

    def online(self) -> int:
        return sum(s.state != "offline" for s in self.agents.values())
