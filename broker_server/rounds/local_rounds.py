"""Model swapping's ``local`` rounds (seed 004, Alg. 4-1): agents train on their own models and upload nothing.

The thesis's traffic saving (§4-9-1: (h1 − 1)/h1 of FedAvg's) rests on it. A local round's task is
published as any other; each selected agent trains on from its own newest model and keeps the result on
its device; its signed status (``last_completed_round``) tells the server it did (``trained_news``),
and the round closes once nobody is waited for, or at the deadline, like any round — with nothing to
aggregate, no model published, no privacy spent, and ``bytes_up`` 0. The server's record of every agent
(its assignment: the last model the server named to it) stays as it was: the next round's task says
``continues`` (``AgentStart``), so each agent trains on from its local rounds' model and uploads its change
from that named model, the influence bounds and differential privacy's clip then bounding the whole
change since the server last saw it. ``RoundEngine.local``, over the engine's ``state``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace

import numpy as np

from broker_server.pool import POOL
from broker_server.rounds.disk import DiskError
from broker_server.rounds.engine_state import EngineState
from broker_server.rounds.metrics_log import round_metrics
from broker_server.rounds.pipeline import RoundContext
from protocol.messages import AgentStatus, RoundMetrics


class LocalRounds:
    """``needs_global``: whether an agent trains with the global model this round (``RoundEngine.needs_global``)."""

    def __init__(self, state: EngineState, *, needs_global: Callable[[str], bool]) -> None:
        self.state, self.needs_global = state, needs_global

    def continues(self) -> bool:
        """Whether the open round's agents train on from their local rounds' models: the round before was one, as
        it closed (not as the schedule says now: a run's last round averages, and ``server.rounds`` may be
        raised after it to go on with the run)."""
        rs, last = self.state.round_state, self.state.last_metrics or {}
        return rs is not None and last.get("round") == rs.round - 1 and last.get("action") == "local"

    def global_downloads(self) -> int:
        """How many selected agents download the global model for the open round: those that start from it,
        unless they train on from local rounds (they already hold it)."""
        rs = self.state.round_state
        assert rs is not None
        # the shared pool (``broker_server.pool.shared``) trains in the server: it downloads nothing
        return 0 if self.continues() else sum(self.needs_global(agent) for agent in rs.selected if agent != POOL)

    def trained_news(self, status_of: Callable[[str], AgentStatus | None]) -> list[str]:
        """The agents the open ``local`` round still waits for whose standing signed status (``status_of``) says
        they trained it (``last_completed_round`` of this server run). Read on every tick rather than once per
        status message, so a status whose news could not be written at once (the disk full, say) still counts."""
        rs = self.state.round_state
        if rs is None or rs.action != "local":
            return []
        done = (self.state.run_id, rs.round)
        return [a for a in rs.pending if (s := status_of(a)) is not None and (s.run_id, s.last_completed_round) == done]

    def trained_locally(self, agents: list[str]) -> None:
        """``agents`` trained the open ``local`` round (``trained_news``): they are not waited for any more."""
        rs = self.state.round_state
        assert rs is not None and rs.action == "local"
        rs.trained.extend(a for a in agents if a in rs.pending)
        self.state.checkpoint()

    def close(self, now: float, model_wire_bytes: int) -> RoundMetrics:
        """End a ``local`` round: agents that trained it start the next from what they hold (their assignments
        now say ``local``: nothing is sent to them again); the metrics line has no evaluation (no model
        left any device) and ``bytes_up`` 0."""
        state = self.state
        rs = state.round_state
        assert rs is not None and rs.action == "local"
        if now >= rs.deadline:
            late = rs.waited_for
            state.health.back_off(late, rs.round, "missed the deadline", now)
            rs.missed.extend(a for a in late if a not in rs.missed)
        for agent in rs.trained:
            if agent in state.assignments:
                state.assignments[agent] = replace(state.assignments[agent], source="local")
        ctx = RoundContext(state=rs, global_arrays={}, global_vector=np.zeros(0, np.float32), float_spec=(),
                           open_delta=lambda agent: np.zeros(0, np.float32))  # fmt: skip
        bytes_down = model_wire_bytes * self.global_downloads() + rs.inbox_bytes
        metrics = round_metrics(ctx, strategy=state.strategy.name, models=state.strategy.models, now=now,
                                outcome=("committed", "", []), version=state.version, run_id=state.run_id,
                                bytes_down=bytes_down)  # fmt: skip
        metrics = replace(metrics, accepted=list(rs.trained))
        if state.config.privacy.enabled:
            metrics = replace(metrics, privacy=state.ledger.summary())
        state.round_state, state.next_round = None, rs.round + 1
        state.checkpoint(last_metrics=json.loads(metrics.to_json()))
        state.outputs_pending.add("metrics")
        with suppress(DiskError):  # tried again on the daemon's next ticks
            state.flush_outputs()
        return metrics
