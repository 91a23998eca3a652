"""Buffered asynchronous rounds (``rounds.mode = "async"``; FedBuff, Nguyen et al., AISTATS 2022) on the round engine.

An asynchronous round is one buffer, and each buffer that closes publishes one model version. It opens on the model
in force; every idle agent that is online joins it (``join``: on the server's word, at most ``rounds.max_concurrent``
training at once, so a returning fleet does not stampede), and it closes once ``rounds.buffer`` updates are in: its
own and late ones, trained from older versions by agents that were still training when their buffer closed. Those
go on training; their update is folded into whichever buffer is open when it arrives, as its change (FedBuff's
delta), weighted by the staleness function of how many versions it is behind (``flcore.staleness``), and refused as
``stale`` beyond ``rounds.max_staleness`` versions (``broker_server.rounds.late_folds``). One update per agent per
buffer: an agent with one in the open buffer joins the next. ``RoundEngine.buffer``, over the engine's ``state``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

from broker_server.rounds.accept import LateWindow
from broker_server.rounds.engine_state import EngineState
from flcore.rounds import RoundRules, RoundState


class AsyncRounds:
    def __init__(self, state: EngineState, rules: RoundRules, seed: int) -> None:
        self.state, self.rules, self.seed = state, rules, seed

    def select(self, idle: list[str], busy: set[str], number: int, salt: int = 0) -> list[str]:
        """Of the ``idle`` agents (eligible, not ``busy``: their status says they are training), as many as
        ``rules.max_concurrent`` leaves room for beside the agents training on the server's word (busy and in
        flight: an agent's claim alone holds no room), drawn reproducibly for round ``number``."""
        candidates = sorted(set(idle) - busy)
        training = busy & set(self.in_flight())
        room = self.rules.max_concurrent - len(training) if self.rules.max_concurrent else len(candidates)
        take = max(0, min(room, len(candidates)))
        return sorted(random.Random(self.seed * 100_003 + number * 101 + salt).sample(candidates, take))

    def join(self, idle: list[str], busy: set[str], now: float) -> list[str]:
        """Idle agents that join the open buffer now (none in it yet, none with an update in it), added to its
        selected agents; the caller publishes the task again."""
        rs = self.state.round_state
        assert rs is not None and self.rules.is_async
        taken = set(rs.selected) | {u.agent for u in rs.updates}
        joined = self.select([a for a in idle if a not in taken], busy | set(rs.pending), rs.round, len(rs.selected))
        # (the open buffer's pending agents hold room whatever their status says: the server asked them)
        rs.selected.extend(joined)
        if joined:
            rs.asked_at = now
        return joined

    def unsettled(self, settled: Callable[[str, LateWindow], bool]) -> set[str]:
        """Agents a closed buffer still owes an update that may still be training or sending it, or whose late update
        is in the open buffer: not ``settled`` (``BufferJoins.settled``)."""
        return {a for w in self.state.late for a in w.owed if not settled(a, w)}

    def in_flight(self) -> list[str]:
        """Agents the open buffer, or a closed one within ``max_staleness``, still waits for an update from."""
        rs = self.state.round_state
        owed = {a for w in self.state.late for a in w.owed}
        if rs is not None:
            owed |= set(rs.pending)
            owed -= {u.agent for u in rs.updates}
        return sorted(owed)

    def status(self) -> dict:
        """The buffer as ``server/status`` shows it: its size, how full it is, and how many agents are training."""
        rs = self.state.round_state
        return {"size": self.rules.buffer, "filled": len(rs.updates) if rs is not None else 0,
                "in_flight": len(self.in_flight())}  # fmt: skip


def buffer_metrics(state: RoundState, rules: RoundRules) -> dict:
    """A closed buffer's line in ``metrics.buffer``: its size, the updates it folded, their staleness (mean, max
    and a histogram over versions behind), and the updates refused as stale while it was open."""
    stalenesses = [u.staleness for u in state.updates]
    counts = Counter(stalenesses)
    return {
        "size": rules.buffer,
        "updates": len(stalenesses),
        "late": sum(1 for u in state.updates if u.late_from),
        "staleness_mean": round(sum(stalenesses) / len(stalenesses), 4) if stalenesses else 0.0,
        "staleness_max": max(stalenesses, default=0),
        "staleness": {str(s): counts[s] for s in sorted(counts)},
        "stale_refused": len(state.wasted.get("stale", [])),
    }
