"""Who the server trusts while it runs: the enrolled folder, watched, and the group key that follows it.

Enrolling or revoking an agent takes effect without a restart. Every ``WATCH_INTERVAL_S`` the folder's
``.pub`` files are compared (name, size, modification time) with what is loaded:

- a new file enrols the agent (``skyfed provision`` adding a device, ``skyfed keys enroll``), and the
  retained statuses are asked for again, so it gets the group key at once instead of at its next status;
- a file that disappears (``skyfed keys revoke`` and ``skyfed provision revoke`` move it to
  ``revoked/``), holds another key, or no longer parses drops the agent's key at once: the next chunk or status it
  signs is refused (``unknown-sender``), it is never selected again, and the group key rotates, so it
  cannot read any model published afterwards, even holding every key it had and every message the
  broker carries. A revoked agent's retained status is cleared, so monitors stop listing it. A file
  written again with the same key (a re-run of ``keys enroll``) changes nothing.

``keys.rotate_every_rounds`` also rotates the key on a schedule, before every N-th round. A rotation
re-publishes the current model under the new key and sends the key to every agent online; agents
become eligible again as soon as their signed status shows the new key id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from broker_server.groupkeys import GroupKeyDistributor
from broker_server.ignored import IgnoredAgents
from broker_server.registry import AgentRegistry
from security.keys import GroupKey, KeyFileError, PublicIdentity, revoked_names, snapshot

log = logging.getLogger("skyfed.server")

WATCH_INTERVAL_S = 1.0


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
        self._files = snapshot(enrolled_dir)
        self._checked = 0.0
        self._rotated_before = 0

    def poll(self, now: float) -> None:
        """Apply changes to the enrolled folder (at most every ``WATCH_INTERVAL_S``)."""
        if now - self._checked < WATCH_INTERVAL_S:
            return
        self._checked = now
        files = snapshot(self.enrolled_dir)
        if files == self._files:
            return
        touched = {name for name in files if name in self._files and files[name] != self._files[name]}
        same = {name for name in touched if self._holds_the_trusted_key(name)}  # copied again, not re-keyed
        dropped = sorted(name for name in self._files if files.get(name) != self._files[name] and name not in same)
        enrolled = False
        for name in dropped:
            self.keyring.remove(name)
            self.registry.forget(name)
        for name in sorted(name for name in files if self._files.get(name) != files[name] and name not in same):
            try:
                public = PublicIdentity.load(self.enrolled_dir / f"{name}.pub")
            except KeyFileError as exc:
                log.error("enrolment refused agent=%s reason=%s", name, exc)
                continue
            if public.name != name:
                log.error("enrolment refused file=%s.pub reason=it holds the key of %r", name, public.name)
                continue
            self.keyring.add(public)
            enrolled = True
            log.info("agent enrolled agent=%s fingerprint=%s", name, public.fingerprint())
        self._files = files
        self.ignored.revoked = revoked_names(self.enrolled_dir)
        gone = [name for name in dropped if name not in self.keyring]
        replaced = [name for name in dropped if name in self.keyring]
        if gone:
            log.warning("agent revoked agent=%s: its messages are refused from now on", ",".join(gone))
            for name in gone:
                self.on_revoked(name)
        if replaced:
            log.warning("agent re-keyed agent=%s: only its new key is trusted", ",".join(replaced))
        if dropped:
            self.rotate(f"{'revoked' if gone else 're-keyed'} {','.join(dropped)}")
        if enrolled:
            self.on_enrolled()

    def _holds_the_trusted_key(self, name: str) -> bool:
        """Whether ``name``.pub, rewritten, still holds the key the server trusts for ``name``."""
        trusted = self.keyring.get(name)
        try:
            loaded = PublicIdentity.load(self.enrolled_dir / f"{name}.pub")
        except KeyFileError:
            return False
        return trusted is not None and (loaded.name, loaded.raw()) == (trusted.name, trusted.raw())

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
