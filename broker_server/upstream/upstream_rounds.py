"""How a region's running aggregator follows its root (``[upstream]``, ``broker_server.upstream.handoff``): a regional
round begins only for a root round that waits for this region, from the root's model; when it closes, its
aggregate goes back to the root instead of out to the region's agents, who get the root's next model.
``Aggregator.regional``, with ``[upstream]`` only.
"""

from __future__ import annotations

import logging

from broker_server.agents.publisher import ModelPublisher
from broker_server.rounds.disk import DiskWatch
from broker_server.rounds.engine import RoundEngine
from broker_server.upstream.handoff import RegionResult, RootRound, UpstreamHandoff
from flcore.rounds import RoundState
from models.weights import spec_mismatch, spec_of
from protocol.messages import RoundMetrics

log = logging.getLogger("skyfed.server")
UPLOAD_MARGIN_S = 5.0  # a regional round closes this long before the root's deadline, to send its aggregate up


class UpstreamRounds:
    def __init__(self, upstream: UpstreamHandoff, engine: RoundEngine, *, disk: DiskWatch,
                 publisher: ModelPublisher) -> None:  # fmt: skip
        self.upstream, self.engine, self.disk, self.publisher = upstream, engine, disk, publisher
        self._adopted: tuple[int, int] | None = None  # the root round and attempt whose model is ours
        self._root_round: RootRound | None = None  # the root round the open (or next) regional round is for

    def phase(self) -> str:
        """The daemon's phase between rounds: waiting for agents while a root round waits for this region."""
        return "waiting-for-agents" if self.upstream.pending() is not None else "waiting-for-root"

    def may_begin(self, now: float) -> bool:
        """Whether a regional round may begin: only for a root round that waits for it, whose model is adopted as
        ours first (published to the region's agents)."""
        request = self.upstream.pending()
        if request is None:
            return False
        if self._adopted != (request.round, request.attempt) and not self._adopt(request, now):
            return False
        self._root_round = request
        return True

    def _adopt(self, request: RootRound, now: float) -> bool:
        if (problem := spec_mismatch(request.model, spec_of(self.engine.global_arrays))) is not None:
            model = self.engine.config.server.model
            why = f"the root's model does not fit this region's server.model {model}: {problem}"
            log.error("root round %d refused: %s", request.round, why)
            self.upstream.deliver(RegionResult(request.round, None, reason=why))
            return False
        version = self.engine.version
        with self.disk.writing(now, self.engine.state.durably(f"root round {request.round}'s model")):
            self.engine.state.adopt(request.model)
        if self.engine.version == version:  # not written: tried again on a later tick
            return False
        self._adopted = (request.round, request.attempt)
        self.publisher.publish(self.engine.version, self.engine.global_arrays)
        log.info("root model adopted root_round=%d attempt=%d version=%d", request.round, request.attempt,
                 self.engine.version)  # fmt: skip
        return True

    def root_deadline(self, now: float) -> float | None:
        """The latest a regional round may close and still reach the root in time (its deadline, less the time
        to send the aggregate up); None when the root's deadline is too close to matter (the round then keeps
        its own deadline instead of closing at once)."""
        if self._root_round is None:
            return None
        latest = self._root_round.deadline - UPLOAD_MARGIN_S
        return latest if latest > now + UPLOAD_MARGIN_S else None

    def begun(self) -> None:
        if self._root_round is not None:
            self.upstream.begun(self._root_round)

    def deliver(self, rs: RoundState, metrics: RoundMetrics) -> None:
        """The regional round closed: its aggregate (or why there is none) to the participant's half."""
        if self._root_round is None:
            return
        root_round = self._root_round.round
        if metrics.outcome == "committed" and metrics.accepted:
            accepted = [u for u in rs.on_time if u.agent in metrics.accepted]  # the weight: this round's own updates
            cap = metrics.aggregation.get("sample_cap")
            result = RegionResult.of_round(root_round, self.engine.global_arrays, accepted, metrics.eval, cap,
                                           metrics.personal)  # fmt: skip
        else:
            result = RegionResult(root_round, None, reason=f"{metrics.outcome}: {metrics.reason or '-'}")
        delivered = self.upstream.deliver(result)
        log.info("regional aggregate for root round %d %s weight=%d%s", root_round,
                 "sent up" if delivered else "dropped (the root no longer waits for it)", result.weight,
                 f" reason={result.reason}" if result.reason else "")  # fmt: skip
        self._root_round = None
