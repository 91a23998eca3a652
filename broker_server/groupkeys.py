"""The federation's group key: kept in ``<state_dir>/group.key`` (0600), delivered sealed to each agent.

When an enrolled agent's status shows another ``group_key_id`` than the current one, the key is sealed
to that agent's X25519 key (``kind = groupkey``) and published on its inbox, at most every
``RESEND_S`` seconds per agent, at once after the agent (re)started. ``rotate`` makes a new key (on
revocation, or on schedule: ``broker_server.trust``) and sends it at once to the agents online; keys
are looked up by id, so agents hold the old one until the new one arrives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from common.files import atomic_write
from protocol.messages import AgentStatus
from security.envelope import seal
from security.keys import GroupKey, Identity, Keyring

log = logging.getLogger("skyfed.server")

RESEND_S = 15.0


def load_or_create(path: Path) -> GroupKey:
    return GroupKey.from_bytes(path.read_bytes()) if path.exists() else create(path)


def create(path: Path) -> GroupKey:
    """A new key, saved (0600) before anything is sealed under it."""
    key = GroupKey.generate()
    atomic_write(path, key.to_bytes(), mode=0o600)
    return key


class GroupKeyDistributor:
    def __init__(
        self,
        path: Path,
        *,
        identity: Identity,
        keyring: Keyring,
        federation: str,
        send: Callable[[str, list[bytearray]], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.key = load_or_create(path)
        self.identity = identity
        self.keyring = keyring
        self.federation = federation
        self.send = send
        self.clock = clock
        self._sent_at: dict[str, float] = {}

    def on_status(self, agent: str, previous: AgentStatus | None, status: AgentStatus | None) -> None:
        """Send the key if this agent lacks it (at once if it just (re)started or just lost it)."""
        if previous is None or previous.state == "offline" or previous.group_key_id == self.key.key_id:
            self._sent_at.pop(agent, None)
        if status is None or status.state == "offline" or status.group_key_id == self.key.key_id:
            return
        if self.clock() - self._sent_at.get(agent, -RESEND_S) >= RESEND_S:
            self.send_to(agent)

    def rotate(self, online: list[str]) -> GroupKey:
        """Replace the key (in ``path``) and send the new one to the ``online`` agents still enrolled."""
        self.key = create(self.path)
        self._sent_at.clear()
        for agent in online:
            self.send_to(agent)
        return self.key

    def send_to(self, agent: str) -> None:
        public = self.keyring.get(agent)
        if public is None:
            return
        _, chunks = seal(
            self.key.to_bytes(),
            sender=self.identity,
            federation=self.federation,
            kind="groupkey",
            round=0,
            recipient=public,
        )
        self.send(agent, chunks)
        self._sent_at[agent] = self.clock()
        log.info("group key sent agent=%s key_id=%s", agent, self.key.key_id)
