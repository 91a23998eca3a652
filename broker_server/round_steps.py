"""Which steps close a round, in order, for a given configuration (``broker_server.pipeline``).

    bound influence → [keep agents' models] → aggregate → check → [add DP noise] → [evaluate]

Model-keeping strategies add ``KeepAgentModels``; ``[privacy]`` adds ``AddNoise`` after the check of the
clipped average, so the evaluation and everything published see only the noisy model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from broker_server.agent_models import ModelBank
from broker_server.bounds import InfluencePolicy
from broker_server.config import ServerConfig
from broker_server.noise import AddNoise
from broker_server.pipeline import Aggregate, BoundInfluence, CheckModel, Evaluate, KeepAgentModels, Step
from broker_server.strategies.base import Strategy
from broker_server.strategies.swapping import ModelSwapping
from models.weights import NamedArrays

log = logging.getLogger("skyfed.server")


def round_steps(
    config: ServerConfig,
    strategy: Strategy,
    policy: InfluencePolicy,
    bank: ModelBank,
    base_of: Callable[[str], np.ndarray],
    pairing_rng: Callable[[], np.random.Generator],
    evaluator: Callable[[NamedArrays], dict[str, float]] | None,
) -> list[Step]:
    steps: list[Step] = [BoundInfluence(policy)]
    if isinstance(strategy, ModelSwapping):
        steps.append(KeepAgentModels(strategy, bank, base_of, pairing_rng, policy))
        cycle = strategy.options.h1 * strategy.options.h2
        if config.server.rounds % cycle:
            log.warning("server.rounds = %d is not a multiple of h1*h2 = %d: the last %d rounds' training never "
                        "reaches the final global model", config.server.rounds, cycle,
                        config.server.rounds % cycle)  # fmt: skip
    steps += [Aggregate(strategy), CheckModel(policy, strategy.bounded_by_clip, private=config.privacy.enabled)]
    if config.privacy.enabled:
        steps.append(AddNoise(config.privacy))
    if evaluator is not None:
        steps.append(Evaluate(evaluator))
    return steps
