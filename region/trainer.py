"""The region's participant trains by running a round: the plug-in that makes a whole region one participant
of its root (``participant.trainer.Trainer``). A region's agents train with the client recipes of the region's
own strategy (docs/architecture.md, "Recipes"), so a root round that asks for another recipe, or other options,
is declined naming it instead of run without it."""

from __future__ import annotations

import time

from broker_server.upstream.handoff import RootRound, UpstreamHandoff
from flcore.update import TrainResult
from models.weights import NamedArrays
from participant.declined import TrainingDeclined
from participant.trainer import PeerContext
from protocol.messages import RecipeRecord, RoundTask


class RegionalTrainer:
    """Hands the root's round and model to the region's aggregator and returns its aggregate, weighted by the
    region's total weight; the edge agent's ``RoundClient`` then sends it up as a delta from the root's model.
    A regional round that does not commit in time raises (``RegionalRoundFailed``): the participant reports
    its training failed, and the root excuses the region for that round."""

    budget = None  # a region spends no local DP budget of its own (its aggregator may add central noise)

    def __init__(self, handoff: UpstreamHandoff, name: str, recipes: tuple[RecipeRecord, ...] = ()) -> None:
        self.handoff = handoff
        self.name = name  # the region's id in the root's federation
        self.recipes = recipes  # what the region's own strategy asks of its agents, as signed

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        for record in task.train_of(self.name).recipes:
            if record not in self.recipes:
                own = ", ".join(f"{r.name} {r.options}" for r in self.recipes) or "none"
                raise TrainingDeclined(f"recipe-refused: the root asks for recipe {record.name} {record.options}; "
                                       f"this region's agents follow its own strategy's ({own}): give the region "
                                       "the root's strategy")  # fmt: skip
        request = RootRound(task.round, task.attempt, global_arrays, task.deadline)
        result = self.handoff.ask(request, timeout_s=task.deadline - time.time())
        assert result.model is not None  # ``ask`` raised otherwise
        return TrainResult(arrays=result.model, samples=result.weight, loss=result.loss, local_eval=result.evaluation,
                           start_eval=result.reported("c_spe"),
                           trained_eval=result.reported("trained_c_spe"))  # fmt: skip
