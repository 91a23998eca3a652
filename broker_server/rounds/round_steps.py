"""Which steps close a round, in order, for a given configuration (``broker_server.rounds.pipeline``).

    bound influence → [keep agents' models] → aggregate → [scale the buffer's step] → plan starts → check →
    [bound the step | add DP noise → [adapt the clip] → server step → [scale the buffer's step]] →
    [evaluate → export ONNX | agents' evaluation (partial aggregation)]

Model-keeping strategies add ``KeepAgentModels``. ``[privacy]`` adds ``AddNoise`` (calibrated to the
strategy's sensitivity) after the check of the clipped average, so the evaluation and everything
published see only the noisy model; a server optimizer then steps on the noisy average (``ServerStep``),
and ``adaptive_clip`` adds ``AdaptClip``. The step bound (``BoundChange``) is left out under privacy: its
verdict would be taken on the un-noised average (every update is clipped to privacy.clip instead); and for
strategies that keep each agent's model, whose published average after swap or local rounds is more than
one round's step (the kept models have their own drift bound, ``KeepAgentModels``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from broker_server.config import ServerConfig
from broker_server.privacy.adaptive_clip import AdaptClip
from broker_server.privacy.noise import NORM_SLACK, AddNoise
from broker_server.rounds.buffer_step import ScaleBuffer
from broker_server.rounds.keep_step import KeepAgentModels
from broker_server.rounds.onnx_step import ExportOnnx
from broker_server.rounds.pipeline import (
    AgentsEvaluation,
    Aggregate,
    BoundChange,
    BoundInfluence,
    CheckModel,
    Evaluate,
    PlanStarts,
    RoundContext,
    ServerStep,
    Step,
)
from broker_server.rounds.screen_step import ScreenUpdates
from flcore.agent_models import Assignment, ModelBank
from flcore.bounds import InfluencePolicy
from flcore.change_bound import ChangeHistory
from flcore.strategies.base import Strategy
from models.tasks import task_of
from models.weights import NamedArrays

log = logging.getLogger("skyfed.server")


def round_steps(
    config: ServerConfig,
    strategy: Strategy,
    policy: InfluencePolicy,
    bank: ModelBank,
    base_of: Callable[[str], np.ndarray],
    current: Callable[[], dict[str, Assignment]],
    round_rng: Callable[[], np.random.Generator],
    evaluator: Callable[[NamedArrays], dict[str, float]] | None,
    current_clip: Callable[[], float],
    history: ChangeHistory,
    in_force: Callable[[], dict[str, float]],
) -> list[Step]:
    """``base_of`` says the float vector an agent started the round from, ``current`` what every agent
    started from, ``round_rng`` a generator seeded for the round; ``current_clip`` says differential
    privacy's clip for the round being closed; ``history`` holds the committed steps' norms and ``in_force``
    says the evaluation of the model in force."""
    private = config.privacy.enabled
    steps: list[Step] = [BoundInfluence(policy, current_clip if private else None)]
    if policy.screen_below > 0:
        detector = task_of(config.server.model) == "detect"
        if evaluator is None or private or strategy.keeps_models or detector or strategy.personal_part:
            why = ("no server.eval_data" if evaluator is None else "[privacy] (a verdict on un-noised updates)"
                   if private else "a detector's evaluation has no loss to compare" if detector
                   else f"strategy {strategy.name}: {strategy.personal_part}" if strategy.personal_part
                   else f"strategy {strategy.name} keeps each agent's model")  # fmt: skip
            log.info("small rounds are not screened (bounds.screen_below = %d): %s", policy.screen_below, why)
        else:
            steps.append(ScreenUpdates(evaluator, in_force, strategy, policy.screen_below))
    if strategy.keeps_models:
        steps.append(KeepAgentModels(bank, base_of, policy, private=private))
    release_std = None
    if private:  # a model released to one agent (model swapping): z·S' (``gaussian.release``)
        def release_std(ctx: RoundContext) -> float:
            assert ctx.influence is not None
            return config.privacy.noise_multiplier * ctx.influence.clip_bound * (1 + NORM_SLACK)
    scale = [ScaleBuffer(config.rounds.server_lr)] if config.rounds.is_async else []  # FedBuff's step
    steps += [
        Aggregate(strategy, average_only=private),
        *([] if private else scale),
        PlanStarts(strategy, bank, current, round_rng, evaluator, release_std),
        CheckModel(policy, strategy.bounded_by_clip, private=private),
        *([] if private or strategy.keeps_models else [BoundChange(policy, history)]),
    ]
    if policy.change_multiple > 0 and (private or strategy.keeps_models):
        log.info("published steps are not held to bounds.change_multiple = %g: %s", policy.change_multiple,
                 "[privacy] clips every update instead" if private else
                 f"strategy {strategy.name} keeps each agent's model (the drift bound holds them)")  # fmt: skip
    partial = config.server.share != "full" or strategy.personal_part
    if policy.collapse_ratio > 0 and (evaluator is None or partial):
        log.info("a collapsing evaluation cannot roll a round back (bounds.collapse_ratio = %g): %s",
                 policy.collapse_ratio, "no server.eval_data" if evaluator is None else "the agents evaluate their "
                 f"own models ({strategy.personal_part or 'server.share'})")  # fmt: skip
    if private:
        steps.append(AddNoise(config.privacy, strategy.dp_sensitivity))
        if config.privacy.adaptive_clip:
            steps.append(AdaptClip(config.privacy))
        steps += [ServerStep(strategy), *scale]
    if config.server.share != "full":  # agents' personalized models: only they can evaluate them
        return [*steps, AgentsEvaluation()]
    if evaluator is not None:
        steps.append(Evaluate(evaluator, in_force, 0.0 if partial else policy.collapse_ratio))
    if config.server.onnx:
        names = config.server.classes or [str(i) for i in range(config.server.num_classes)]
        path = config.state_dir / "global_model.onnx"
        steps.append(ExportOnnx(config.server.model, names, config.training.image_size, path))
    return steps
