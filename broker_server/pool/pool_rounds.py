"""How the running server drives its shared pool (``broker_server.pool.shared``): the pool starts training when a
round that waits for it is announced, and its finished update goes to the same acceptance as an agent's
(``accept``, the daemon's: refusals are logged, counted and listed in the round's ``rejected`` under
``server-pool``). ``Aggregator.pool_rounds``, with ``[pool]`` only.
"""

from __future__ import annotations

from collections.abc import Callable

from broker_server.pool import POOL
from broker_server.pool.shared import SharedPool
from broker_server.rounds.engine import RoundEngine
from protocol.messages import RoundTask
from protocol.transfer import Completed


class PoolRounds:
    """``round_change``: a change to the open round written durably, the round closed if nobody is left to wait
    for (``Aggregator``)."""

    def __init__(self, pool: SharedPool, engine: RoundEngine, *, accept: Callable[[Completed], None],
                 round_change: Callable[[str, Callable[[], bool]], None],
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self.pool, self.engine, self.accept, self.round_change, self.clock = pool, engine, accept, round_change, clock

    def start(self, task: RoundTask) -> None:
        """The round waits for the pool's update: train it now, on a thread (once per round)."""
        if POOL in task.pending:
            self.pool.start(task, self.engine.global_arrays)

    def poll(self) -> None:
        """The pool's finished update into the round, like an agent's; a job whose round closed is dropped, and a
        failed training excuses the pool from its round (``FleetEvents.gave_up``)."""
        rs = self.engine.round_state
        if self.pool.round is not None and (rs is None or rs.round != self.pool.round):
            self.pool.cancel("its round closed")
            return
        result = self.pool.poll()
        if result is None:
            return
        if result.update is not None:
            self.accept(result.update)
            return
        why = f"its training failed: {result.reason}"
        self.round_change(f"{POOL} excused", lambda: self.engine.fleet.gave_up(POOL, result.round, why, self.clock()))
