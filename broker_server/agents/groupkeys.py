"""The federation's group key: kept in ``<state_dir>/group.key`` (0600), delivered sealed to each agent.

When an enrolled agent's status shows another ``group_key_id`` than the current one, the key is sealed
to that agent's X25519 key (``kind = groupkey``) and published on its inbox: at once the first time,
then again only while its statuses go on without the key, after a wait that doubles from ``RESEND_S`` up
to ``RESEND_MAX_S``; an agent that (re)connected is back at ``RESEND_S`` (a connection that keeps dropping
got a key per reconnect). A status lags the key on a loaded machine (a host process of 100 agents works
through a backlog of chunks before the key): a resend every 15 s there sent 3,399 keys to 1,000 agents in
9 minutes, each making its agent fetch the retained model again (docs/results/scale.md). ``rotate`` makes a new key (on
revocation, or on schedule: ``broker_server.agents.trust``) and sends it at once to the agents online; keys are
looked up by id, so agents hold the old one until the new one arrives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.files import atomic_write
from protocol.messages import AgentStatus
from security.envelope import seal
from security.keys import GroupKey, Identity, Keyring

log = logging.getLogger("skyfed.server")

RESEND_S = 15.0  # the first wait for a status holding the key, and the least between two sends to one agent
RESEND_MAX_S = 240.0  # the longest: an agent that stays without the key still gets it every 4 minutes


@dataclass(frozen=True)
class Sent:
    """The key's last send to one agent still without it, and how many were sent since it last held it."""

    at: float
    sends: int

    def wait_s(self) -> float:
        """How long its statuses may lag this send before the key goes again."""
        return min(RESEND_S * 2 ** (self.sends - 1), RESEND_MAX_S)


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
        self._sent: dict[str, Sent] = {}  # agents sent the current key whose statuses do not show it yet
        self._all_held = False  # every agent sent the current key has held it once (``on_status`` said so)

    def on_status(self, agent: str, previous: AgentStatus | None, status: AgentStatus | None) -> bool:
        """Send the key if this agent lacks it: at once if it just (re)started or just lost it, else once its
        statuses went on without it for longer than the last send's wait (``Sent.wait_s``). True when this status
        confirmed the last key sent, the first time for this key: every agent it went to holds it now, so a round
        may open at once."""
        if status is None or status.state == "offline":
            return False
        if status.group_key_id == self.key.key_id:  # it holds the key: a later loss starts again at once
            if self._sent.pop(agent, None) is None or self._sent or self._all_held:
                return False
            self._all_held = True  # once a key: an agent that drops and regains it again and again wakes nobody
            return True
        sent = self._sent.get(agent)
        if sent is not None and (previous is None or previous.state == "offline"):  # a new connection, maybe a
            sent = self._sent[agent] = Sent(at=sent.at, sends=1)  # new process without the key: shortest wait
        if sent is None or self.clock() - sent.at >= sent.wait_s():
            self.send_to(agent)
        return False

    def rotate(self, online: list[str]) -> GroupKey:
        """Replace the key (in ``path``) and send the new one to the ``online`` agents still enrolled."""
        self.key = create(self.path)
        self._sent.clear()
        self._all_held = False
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
        sent = self._sent.get(agent)
        self._sent[agent] = Sent(at=self.clock(), sends=1 if sent is None else sent.sends + 1)
        log.info("group key sent agent=%s key_id=%s sends=%d next_after_s=%.0f", agent, self.key.key_id,
                 self._sent[agent].sends, self._sent[agent].wait_s())  # fmt: skip
