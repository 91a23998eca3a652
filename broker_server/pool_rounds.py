"""How the running server drives its shared pool (``broker_server.pool``): the pool starts training when a
round that waits for it is announced, and its finished update goes to the same acceptance as an agent's
(``Aggregator._accept``: refusals are logged, counted and listed in the round's ``rejected`` under
``server-pool``). Mixed into the daemon (``broker_server.daemon.Aggregator``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_server.config import POOL
from protocol.messages import RoundTask

if TYPE_CHECKING:
    from broker_server.daemon import Aggregator


class PoolRounds:
    def _start_pool(self: Aggregator, task: RoundTask) -> None:
        """The round waits for the pool's update: train it now, on a thread (once per round)."""
        if self.pool is not None and POOL in task.pending:
            self.pool.start(task, self.engine.global_arrays)

    def _poll_pool(self: Aggregator) -> None:
        """The pool's finished update into the round, like an agent's; a job whose round closed is dropped, and a
        failed training excuses the pool from its round (``RoundEngine.gave_up``)."""
        if self.pool is None:
            return
        rs = self.engine.round_state
        if self.pool.round is not None and (rs is None or rs.round != self.pool.round):
            self.pool.cancel("its round closed")
            return
        result = self.pool.poll()
        if result is None:
            return
        if result.update is not None:
            self._accept(result.update)
            return
        why = f"its training failed: {result.reason}"
        self._round_change(f"{POOL} excused", lambda: self.engine.gave_up(POOL, result.round, why, self.clock()))
