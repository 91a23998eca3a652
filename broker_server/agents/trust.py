"""Who the server trusts while it runs: the enrolled folder, watched, and the group key that follows it.

Enrolling or revoking an agent takes effect without a restart. Every second the folder's ``.pub`` files
are compared (name, size, modification time) with what is loaded (``security.enrolled_watch``, which a
peer uses too):

- a new file enrols the agent (``skyfed provision`` adding a device, ``skyfed keys enroll``), and the
  retained statuses are asked for again, so it gets the group key at once instead of at its next status;
- a file that disappears (``skyfed keys revoke`` and ``skyfed provision revoke`` move it to
  ``revoked/``), holds another key, or no longer parses drops the agent's key at once: the next chunk or status it
  signs is refused (``unknown-sender``), it is never selected again, and the group key rotates, so it
  cannot read any model published afterwards, even holding every key it had and every message the
  broker carries. A revoked agent's retained status is cleared, so monitors stop listing it. A file
  written again with the same key (a re-run of ``keys enroll``) changes nothing;
- a file named for the shared pool's participant (``server-pool``, with ``[pool]``) is refused and logged,
  as the start check refuses it: that agent is never trusted, so never selected beside the pool.

``keys.rotate_every_rounds`` also rotates the key on a schedule, before every N-th round. A rotation
re-publishes the current model under the new key and sends the key to every agent online; agents
become eligible again as soon as their signed status shows the new key id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from broker_server.agents.groupkeys import GroupKeyDistributor
from broker_server.agents.ignored import IgnoredAgents
from broker_server.agents.registry import AgentRegistry
from security.enrolled_watch import EnrolledWatch
from security.keys import GroupKey, revoked_names

log = logging.getLogger("skyfed.server")


class TrustKeeper:
    def __init__(
        self,
        enrolled_dir: Path,
        *,
        registry: AgentRegistry,
        ignored: IgnoredAgents,
        distributor: GroupKeyDistributor,
        on_rotated: Callable[[GroupKey], None],
        on_enrolled: Callable[[], None],
        on_revoked: Callable[[str], None],
        rotate_every_rounds: int = 0,
        reserved: dict[str, str] | None = None,
    ) -> None:
        self.enrolled_dir = enrolled_dir
        self.keyring = registry.keyring
        self.registry = registry
        self.ignored = ignored
        self.distributor = distributor
        self.on_rotated = on_rotated
        self.on_enrolled = on_enrolled
        self.on_revoked = on_revoked
        self.rotate_every_rounds = rotate_every_rounds
        self.watch = EnrolledWatch(enrolled_dir, registry.keyring, role="agent", log=log, loaded=True,
                                   reserved=reserved)  # fmt: skip
        self._rotated_before = 0

    def poll(self, now: float) -> None:
        """Apply changes to the enrolled folder (``security.enrolled_watch``: at most once a second)."""
        changes = self.watch.poll(now)
        if not changes:
            return
        for name in (*changes.revoked, *changes.rekeyed):
            self.registry.forget(name)
        self.ignored.revoked = revoked_names(self.enrolled_dir)
        if changes.revoked:
            log.warning("agent revoked agent=%s: its messages are refused from now on", ",".join(changes.revoked))
            for name in changes.revoked:
                self.on_revoked(name)
        if changes.rekeyed:
            log.warning("agent re-keyed agent=%s: only its new key is trusted", ",".join(changes.rekeyed))
        if changes.revoked or changes.rekeyed:
            dropped = sorted((*changes.revoked, *changes.rekeyed))
            self.rotate(f"{'revoked' if changes.revoked else 're-keyed'} {','.join(dropped)}")
        if changes.enrolled:
            self.on_enrolled()

    def rotate_on_schedule(self, next_round: int) -> None:
        """Before round ``next_round``, when the schedule says so (once per round, not before the first)."""
        every = self.rotate_every_rounds
        if every and next_round > 1 and (next_round - 1) % every == 0 and self._rotated_before != next_round:
            self._rotated_before = next_round
            self.rotate(f"schedule: every {every} rounds")

    def rotate(self, reason: str) -> None:
        old = self.distributor.key.key_id
        online = [agent for agent in self.registry.online_agents() if agent in self.keyring]
        key = self.distributor.rotate(online)
        self.on_rotated(key)
        log.warning(
            "group key rotated key_id=%s previous=%s reason=%s sent_to=%d", key.key_id, old, reason, len(online)
        )
