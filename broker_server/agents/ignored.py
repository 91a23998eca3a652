"""Agents the server ignores, and how it tells the operator: once an hour per agent and reason, with
the command that fixes it (enrol, re-enrol, re-admit a revoked agent, or correct a federation name).

Anyone can invent topic ids, so ids that are not enrolled are named only for the first few hundred;
past that they share one line. Every ignored message is counted in ``counts`` (the server status).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from common.logs import Throttle
from common.text import printable
from common.untrusted_json import UntrustedJsonError, parse_untrusted_json
from protocol.messages import MAX_JSON_BYTES
from security.keys import REVOKED, Keyring, revoked_names
from security.signing import InvalidDocument, verify_document

log = logging.getLogger("skyfed.server")

IGNORED_LOG_INTERVAL_S = 3600.0  # an agent the server ignores is named once an hour
MAX_IGNORED_NAMED = 256  # beyond this many invented ids, the rest are only counted


class IgnoredAgents:
    def __init__(self, enrolled_dir: Path, keyring: Keyring, federation: str, counts: Counter[str]) -> None:
        self.enrolled_dir = enrolled_dir
        self.keyring = keyring
        self.federation = federation
        self.counts = counts
        self.revoked = revoked_names(enrolled_dir)
        self._log = Throttle(IGNORED_LOG_INTERVAL_S)

    def foreign(self, federation: str, agent: str, payload: bytes) -> None:
        """An agent status from another federation. Signed by the key we enrolled for that id, it is one of our
        agents with a wrong agent.federation; anything else is another federation's agent (on a shared broker
        ids repeat: drone-01 everywhere), none of our business: not counted, named once an hour at debug."""
        if agent not in self.keyring or not payload:
            return
        if not self._signed_by_ours(agent, payload):
            if self._log.allow(f"other:{federation}") is not None:
                log.debug("status ignored federation=%s agent=%s: another federation's agent (not signed by the key "
                          "enrolled here)", printable(federation, 64), printable(agent, 64))  # fmt: skip
            return
        self.counts["ignored-wrong-federation"] += 1
        if self._log.allow(f"foreign:{agent}") is not None:  # per agent: federation names are free
            log.warning(
                "agent ignored agent=%s reason=wrong-federation: it publishes on federation %r, this server runs "
                "%r: set federation = %r in its agent.toml",
                agent, printable(federation, 64), self.federation, self.federation,
            )  # fmt: skip

    def _signed_by_ours(self, agent: str, payload: bytes) -> bool:
        if (public := self.keyring.get(agent)) is None:
            return False
        try:
            verify_document(parse_untrusted_json(payload, max_bytes=MAX_JSON_BYTES), public)
        except (InvalidDocument, UntrustedJsonError):
            return False
        return True

    def status_refused(self, agent: str, reason: str) -> None:
        """A status the registry does not believe: counted, and logged once an hour per agent and kind
        (an agent republishes every few seconds); a re-keyed agent is told how to re-enrol."""
        kind = reason.split(":")[0]
        self.counts[kind] += 1
        if self._log.allow(f"{agent}:{kind}") is None:
            return
        if kind == "status-older":  # also what a restart's re-deliveries look like: not an alarm
            log.info("status ignored agent=%s reason=%s", agent, printable(reason))
            return
        if kind == "status-stale-will":  # someone replays it: the agent's key is fine
            log.warning("status ignored agent=%s reason=%s", agent, printable(reason))
            return
        log.warning(
            "agent ignored agent=%s reason=%s; if its key was re-made, re-enrol this agent: %s",
            agent, printable(reason), self.enrol_command(f"{agent}.pub"),
        )  # fmt: skip

    def enrol_command(self, pub: str) -> str:
        return f"skyfed keys enroll {pub} --enrolled {self.enrolled_dir} (takes effect without a restart)"

    def not_enrolled(self, agent: str) -> None:
        """A status from an id that is not enrolled: counted, and named in the log once an hour with why
        and how to admit it (invented ids past the first few hundred share one line)."""
        revoked = self.enrolled_dir / REVOKED
        if agent in self.revoked:
            self.counts["ignored-revoked"] += 1
            if self._log.allow(agent) is not None:
                log.warning(
                    "agent ignored agent=%s reason=revoked: its key is in %s; to re-admit it: %s",
                    agent, revoked, self.enrol_command(f"{revoked / agent}.pub"),
                )  # fmt: skip
            return
        self.counts["ignored-not-enrolled"] += 1
        named = len(self._log) < MAX_IGNORED_NAMED
        held = self._log.allow(agent if named else "*")
        if held is None:
            return
        if not named:
            log.warning("agent ignored: statuses from more ids that are not enrolled (%d held back)", held)
            return
        name = printable(agent, 64)
        log.warning(
            "agent ignored agent=%s reason=not-enrolled: no %s.pub in %s; to admit it: %s",
            name, name, self.enrolled_dir, self.enrol_command(f"{name}.pub"),
        )  # fmt: skip
