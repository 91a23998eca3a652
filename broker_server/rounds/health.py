"""Which agents deliver: rounds progress without the ones that do not, and an operator is told.

An agent's status is unauthenticated JSON (anyone who may publish on ``agent/<id>/status`` can make a
switched-off agent look ready), so being *asked* rests on a forgeable claim; what counts here is only what the
server saw itself: an authenticated update accepted, or a round it was selected for that it did not deliver,
whatever its status said: a deadline passed without its update (also when the round closed on the quorum
without it), its own signed status said its training failed or was declined, or its whole transfer was
refused. Such an agent is backed off: not selected for 1, 2, 4 … (at most ``MAX_BACKOFF_ROUNDS``) rounds after
each miss since it was last trusted, and, when the miss cost a deadline (it did not say it would not deliver),
for at least as many round deadlines of time: rounds that close in a second without it would otherwise let a
silent agent cost a deadline in every few seconds of the run, where now its misses cost a share of the wall
time that shrinks as the back-off doubles (at most 1 deadline in 33 once capped); an accepted update makes it
selectable again at once, and ``TRUST_AFTER`` accepted updates in a row clear its misses, so an agent that
alternates a miss and a delivery is backed off ever longer (1, 2, 4 … rounds) instead of costing every other
round its deadline. While backed off it is selected only to make up ``rounds.min_agents``, and then on
probation: the round does not wait for it (``rounds.RoundState.probation``). So a forged "ready", a silent or
broken device costs at most one deadline, then ever fewer. Pure bookkeeping; the engine keeps it in the
checkpoint, so a restart forgets nothing.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

log = logging.getLogger("skyfed.server")

MAX_BACKOFF_ROUNDS = 32
TRUST_AFTER = 3  # accepted updates in a row that clear an agent's record of misses


@dataclass
class AgentRecord:
    misses: int = 0  # rounds the agent missed since it was last trusted (``TRUST_AFTER`` deliveries in a row)
    backed_off_until: int = 0  # not selected in rounds up to and including this one
    delivered: int = 0  # accepted updates since its last miss
    backed_off_until_s: float = 0.0  # ... nor before this time (the server's clock; 0 in older checkpoints)

    def backed_off(self, round_number: int, now: float) -> bool:
        return round_number <= self.backed_off_until or now < self.backed_off_until_s


class HealthBook:
    """``deadline_s``: one step of the back-off in time (``rounds.deadline_s``, what a miss can cost)."""

    def __init__(self, records: dict[str, AgentRecord] | None = None, *, deadline_s: float) -> None:
        self.records = records or {}
        self.deadline_s = deadline_s

    def missed(self, agent: str, round_number: int, now: float, *, timed: bool = True) -> AgentRecord:
        """``timed``: the miss cost the round its deadline, so the back-off counts time too; an agent that said
        it will not deliver (training failed, declined, refused whole) cost nothing to wait for: rounds only."""
        record = self.records.setdefault(agent, AgentRecord())
        record.misses += 1
        record.delivered = 0
        steps = min(2 ** (record.misses - 1), MAX_BACKOFF_ROUNDS)
        record.backed_off_until = round_number + steps
        record.backed_off_until_s = now + steps * self.deadline_s if timed else 0.0
        return record

    def back_off(self, agents: list[str], round_number: int, why: str, now: float, *, timed: bool = True) -> None:
        """``missed`` for each of ``agents``, logged with ``why``."""
        for agent in agents:
            record = self.missed(agent, round_number, now, timed=timed)
            log.warning("agent %s agent=%s round=%d misses=%d not_selected_until_round=%d not_selected_for_s=%.0f",
                        why, agent, round_number, record.misses, record.backed_off_until + 1,
                        max(0.0, record.backed_off_until_s - now))  # fmt: skip

    def delivered(self, agent: str) -> None:
        record = self.records.get(agent)
        if record is not None:  # it is alive now: selectable again, but its next miss backs it off longer
            record.delivered += 1
            record.backed_off_until, record.backed_off_until_s = 0, 0.0
            if record.delivered >= TRUST_AFTER:
                del self.records[agent]

    def available(self, agents: list[str], round_number: int, now: float) -> list[str]:
        """``agents`` minus the ones backed off for ``round_number`` at ``now``."""
        return [a for a in agents if not self.records.get(a, AgentRecord()).backed_off(round_number, now)]

    def backed_off(self, round_number: int, now: float) -> dict[str, int]:
        """Agent → misses since last trusted, for the agents not selectable in ``round_number`` at ``now``."""
        return {a: r.misses for a, r in sorted(self.records.items()) if r.backed_off(round_number, now)}

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {agent: asdict(record) for agent, record in self.records.items()}

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, float]], *, deadline_s: float) -> HealthBook:
        return cls({agent: AgentRecord(**record) for agent, record in data.items()}, deadline_s=deadline_s)
