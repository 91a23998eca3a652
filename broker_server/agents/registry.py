"""The server's view of its agents, from their signed status messages: who is online and may be asked.

Status is public JSON on ``agent/<id>/status`` that anyone with publish rights could write, so the
server only believes a status the agent signed (``security.signing``) and that is newer than any it
has seen from that agent: a replayed old "ready" is refused, and so is a status from a device whose
clock went back; the same status delivered twice (as after a server restart) is a harmless duplicate.
An agent is eligible only while its last accepted status arrived within ``status_timeout_s`` (agents
republish every ``status_interval_s``), so a device that died is dropped even if its last words are
replayed. The first status seen from an agent (the broker's retained copy, at the server's start)
counts as received when it was signed, if that is earlier: a switched-off agent's old "ready" makes
it eligible for no longer than a live one's would.

Freshness of the last will. ``offline`` is the agent's signed last will, made when it connects, so it
is older than the statuses that follow it and cannot pass the "newer" test. Each connection is a
*session*: the agent makes a new will for every (re)connection, stamps it with the session's time,
and every status of that session carries that time in ``session``. An ``offline`` status is accepted
only if it is not older than the newest session seen from that agent; a will captured from an
earlier connection (or a clean stop's final status) is refused as ``status-stale-will``, so replaying
it after each real status no longer takes the agent out of the fleet. (An agent from before sessions
sends ``session`` 0: its wills are accepted as before.)

Clock skew. A live status' ``updated_at`` is the agent's clock at signing, read by the server when the
broker delivers it: its time minus the server's is the agent's clock offset less the delivery delay.
Usually that delay is a fraction of a second, but statuses an agent queued through a broker outage
arrive together when it is back, a minute late: so the estimate (``Seen.offset_s``) is the largest of
the last ``OFFSET_SAMPLES`` live statuses, the one delivered soonest. A delay can only lower a sample,
so late ones never make a healthy clock look behind, and a clock really off shows in every sample.
Crossing ``CLOCK_SKEW_TOLERANCE_S`` is logged once each way; the server's status lists the skewed agents.
What an agent *sends* is authenticated separately (``security.envelope``); who *delivers* is tracked
by ``broker_server.rounds.health``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from common.untrusted_json import UntrustedJsonError, parse_untrusted_json
from protocol.messages import MAX_JSON_BYTES, AgentStatus, MessageError
from security.keys import Keyring
from security.signing import InvalidDocument, verify_document


class StatusRefused(Exception):
    """A status the server does not believe; ``reason`` says why in words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


log = logging.getLogger("skyfed.server")
BUSY = frozenset({"training", "uploading", "waiting-model"})  # an agent at work on a task
CLOCK_SKEW_TOLERANCE_S = 30.0  # an agent clock further off than this from the server's is reported
CLOCK_SKEW_CLEARED_S = 15.0  # ... and no longer once back within this (hysteresis: no flapping across one line)
OFFSET_SAMPLES = 8  # live statuses the offset is estimated over: more than a minute's outage queues at 10 s each


@dataclass
class Seen:
    status: AgentStatus
    received_at: float  # server clock
    newest: float  # the newest ``updated_at`` accepted from this agent, offline included or not
    session: float = 0.0  # the newest connection session an accepted status named
    offsets: tuple[float, ...] = ()  # updated_at minus arrival of its last ``OFFSET_SAMPLES`` live statuses
    skewed: bool = False  # reported as skewed (past the tolerance, not yet back within CLOCK_SKEW_CLEARED_S)

    @property
    def offset_s(self) -> float:
        """The agent's clock minus the server's: the sample delivered soonest (0 before any was measured)."""
        return max(self.offsets, default=0.0)


class AgentRegistry:
    def __init__(self, keyring: Keyring, status_timeout_s: float) -> None:
        self.keyring = keyring
        self.status_timeout_s = status_timeout_s
        self.seen: dict[str, Seen] = {}
        self.cleared: dict[str, Seen] = {}  # what was seen of an agent before its status was cleared (no signature
        # clears it: an empty retained payload), so that a replay just after a clear is still refused

    @property
    def agents(self) -> dict[str, AgentStatus]:
        return {agent: seen.status for agent, seen in self.seen.items()}

    def status(self, agent: str) -> AgentStatus | None:
        """``agent``'s newest status, if any is in force."""
        seen = self.seen.get(agent)
        return seen.status if seen is not None else None

    def heard_at(self, agent: str) -> float:
        """When ``agent``'s newest status in force arrived (server clock; 0 for none)."""
        seen = self.seen.get(agent)
        return seen.received_at if seen is not None else 0.0

    def update(self, agent: str, payload: bytes, now: float) -> tuple[AgentStatus | None, AgentStatus | None]:
        """Fold in one status message of an enrolled agent; return ``(previous, current)`` (current None
        when cleared). ``StatusRefused`` if it is not signed by the agent, malformed, or a replay."""
        before = self.seen.get(agent)
        previous = before.status if before is not None else None
        if not payload:
            if before is not None:
                self.cleared[agent] = before
            self.seen.pop(agent, None)
            return previous, None
        public = self.keyring.get(agent)
        assert public is not None, "only enrolled agents reach the registry"
        try:
            document = parse_untrusted_json(payload, max_bytes=MAX_JSON_BYTES)
            status = AgentStatus.from_dict(verify_document(document, public))
        except InvalidDocument as exc:
            raise StatusRefused(
                f"status-{exc.reason}: not signed by the key enrolled for {agent} (forged, or its key was re-made)"
            ) from None
        except (UntrustedJsonError, MessageError) as exc:
            raise StatusRefused(f"status-malformed: {exc}") from None
        if status.agent != agent:
            raise StatusRefused(f"status-mismatch: signed for {status.agent!r}, published as {agent!r}")
        if before is None:  # first sight, likely the retained copy: received no later than it was signed
            floor = self.cleared.get(agent)
            if floor is not None:  # seen before its status was cleared: as fresh as that must be
                refuse_stale(agent, status, floor)
                del self.cleared[agent]
            session = max(status.session, floor.session if floor is not None else 0.0)
            self.seen[agent] = Seen(status, min(now, status.updated_at), status.updated_at, session)
            return previous, status
        if status == before.status:
            return previous, previous  # delivered twice (a persistent session and the retained copy)
        refuse_stale(agent, status, before)
        newest, session, offsets = before.newest, max(before.session, status.session), before.offsets
        if status.state != "offline":
            newest, offsets = status.updated_at, (*offsets, status.updated_at - now)[-OFFSET_SAMPLES:]
        seen = self.seen[agent] = Seen(status, now, newest, session, offsets)
        offset = seen.offset_s
        skewed = seen.skewed = abs(offset) > (CLOCK_SKEW_CLEARED_S if before.skewed else CLOCK_SKEW_TOLERANCE_S)
        if skewed != before.skewed:
            if skewed:
                log.warning("clock skew agent=%s offset_s=%+.1f: its clock is off the server's; fix its time sync "
                            "(NTP)", agent, offset)  # fmt: skip
            else:
                log.info("clock skew gone agent=%s offset_s=%+.1f", agent, offset)
        return previous, status

    def clock_offsets(self) -> dict[str, float]:
        """Agents reported as skewed (``Seen.skewed``): their offsets in seconds."""
        return {a: s.offset_s for a, s in sorted(self.seen.items()) if s.skewed}

    def forget(self, agent: str) -> None:
        """An agent no longer enrolled: never selected again, whatever its last status said."""
        self.seen.pop(agent, None)

    def online_agents(self) -> list[str]:
        return sorted(a for a, seen in self.seen.items() if seen.status.state != "offline")

    def eligible(self, group_key_id: str, now: float) -> list[str]:
        """Agents whose last signed status is recent, online, gate open, and holding the current key."""
        return sorted(
            a
            for a, seen in self.seen.items()
            if now - seen.received_at <= self.status_timeout_s
            and seen.status.state != "offline"
            and seen.status.gate.ok
            and seen.status.group_key_id == group_key_id
        )

    def busy(self, now: float) -> set[str]:
        """Agents whose last recent status says they are training or sending an update (asynchronous rounds leave
        them out of a new buffer and count them against ``rounds.max_concurrent``)."""
        return {a for a, seen in self.seen.items()
                if now - seen.received_at <= self.status_timeout_s and seen.status.state in BUSY}  # fmt: skip

    def online(self, now: float) -> int:
        """Agents whose last status is recent and not ``offline``: the ones the monitor shows as alive."""
        fresh = (seen for seen in self.seen.values() if now - seen.received_at <= self.status_timeout_s)
        return sum(seen.status.state != "offline" for seen in fresh)


def refuse_stale(agent: str, status: AgentStatus, before: Seen) -> None:
    """``StatusRefused`` for a status older than what ``before`` holds: a will from an earlier connection, or
    a live status not newer than the newest seen."""
    if status.state == "offline":
        if status.updated_at < before.session:
            raise StatusRefused(
                f"status-stale-will: an offline status from an earlier connection of {agent} (a replay)"
            )
    elif status.updated_at <= before.newest:
        raise StatusRefused(
            f"status-older: not newer than one already seen from {agent} (a late re-delivery, a "
            "replay, or the device's clock went back)"
        )
