"""The region's participant trains by running a round: the plug-in that makes a whole region one participant
of its root (``participant.trainer.Trainer``)."""

from __future__ import annotations

import time

from broker_server.upstream.handoff import RootRound, UpstreamHandoff
from flcore.update import TrainResult
from models.weights import NamedArrays
from participant.trainer import PeerContext
from protocol.messages import RoundTask


class RegionalTrainer:
    """Hands the root's round and model to the region's aggregator and returns its aggregate, weighted by the
    region's total weight; the edge agent's ``RoundClient`` then sends it up as a delta from the root's model.
    A regional round that does not commit in time raises (``RegionalRoundFailed``): the participant reports
    its training failed, and the root excuses the region for that round."""

    budget = None  # a region spends no local DP budget of its own (its aggregator may add central noise)

    def __init__(self, handoff: UpstreamHandoff) -> None:
        self.handoff = handoff

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        request = RootRound(task.round, task.attempt, global_arrays, task.deadline)
        result = self.handoff.ask(request, timeout_s=task.deadline - time.time())
        assert result.model is not None  # ``ask`` raised otherwise
        return TrainResult(arrays=result.model, samples=result.weight, loss=result.loss,
                           local_eval=result.evaluation)  # fmt: skip
