"""The close-of-round pipeline: small steps over one ``RoundContext``, each separately testable.

    bound influence → [keep agents' models] → aggregate → plan starts → check the model → bound the step
    → evaluate   (then commit)

(``broker_server.rounds.round_steps`` says which steps a configuration gets, differential privacy's among them.)

A step either fills in its part of the context or raises ``RoundRejected`` with a reason and the
agents to blame; any other exception in a step becomes a rejection too (``internal-error in <step>``).
A rejected round is rolled back by the engine: the previous global model stays.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from broker_server.privacy.gaussian import release
from flcore.agent_models import Assignment, Holding, ModelBank
from flcore.aggregation import bounded_contributions, change_limit, check_new_model
from flcore.bounds import Influence, InfluencePolicy, lower_median
from flcore.change_bound import ChangeHistory, collapse, shrink_step
from flcore.onepass import axpy
from flcore.rounds import RoundState
from flcore.strategies.base import Contribution, KeptModels, RoundResult, StartPlan, Strategy
from flcore.update import UpdateRejected
from models.weights import (
    NamedArrays,
    TensorSpec,
    flatten,
    float_part,
    with_floats,
)

DOMINANCE = 2.0  # an agent whose contribution exceeds this multiple of the lower median one is named


class RoundRejected(Exception):
    """The round's aggregate must not become the global model."""

    def __init__(self, reason: str, offenders: list[str] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.offenders = offenders or []


@dataclass
class RoundContext:
    state: RoundState
    global_arrays: NamedArrays
    global_vector: np.ndarray
    float_spec: tuple[TensorSpec, ...]
    open_delta: Callable[[str], np.ndarray]
    contributions: list[Contribution] = field(default_factory=list)
    influence: Influence | None = None
    result: RoundResult | None = None
    candidate: NamedArrays | None = None
    evaluation: dict[str, float] = field(default_factory=dict)
    aggregate_s: float = 0.0
    kept: dict[str, Holding] = field(default_factory=dict)  # each agent's model after the round
    exact: set[str] = field(default_factory=set)  # agents whose kept model is bit for bit their own copy
    plan: StartPlan = field(default_factory=StartPlan)  # what every agent starts the next round from
    step_detail: dict[str, Any] = field(default_factory=dict)  # what steps add to metrics.aggregation (pairs, …)
    noise_std: float = 0.0  # differential privacy's noise on the new model (0: none was added)
    released: dict[str, Holding] = field(default_factory=dict)  # DP with swapping: the noised models (gaussian.release)
    next_clip: float = 0.0  # differential privacy's adaptive clip for the next round (0: unchanged)

    def aggregation_detail(self) -> dict[str, Any]:
        detail: dict[str, Any] = {}
        if self.influence is not None:
            norms = np.array([u.norm for u in self.state.updates])
            claimed = np.array([u.samples for u in self.state.updates], np.float64)
            detail.update(self.influence.describe([u.key for u in self.state.updates], claimed, norms))
        if folded := self.state.folded_late:  # late updates of the round before (``flcore.late``)
            detail["folded_late"] = folded
        if self.result is not None:
            detail.update(self.result.detail)
        detail.update(self.step_detail)
        return detail


class Step(ABC):
    name: str = ""

    @abstractmethod
    def run(self, ctx: RoundContext) -> None: ...


def offenders(contributions: list[Contribution]) -> list[str]:
    """Agents whose (weighted, clipped) contribution dominates the round; everyone if none stands out."""
    if not contributions:
        return []
    total = sum(c.samples for c in contributions) or 1.0
    size = np.array([c.samples / total * c.scale * c.norm for c in contributions])
    size = np.where(np.isfinite(size), size, np.inf)
    reference = lower_median(size)
    named = [c.agent for c, s in zip(contributions, size, strict=True) if s > DOMINANCE * reference]
    return named or [c.agent for c in contributions]


@dataclass
class BoundInfluence(Step):
    """Clip and cap every update (``flcore.bounds``); ``clip_norm``, when given, says the fixed
    clip of this round (differential privacy's adaptive clip)."""

    policy: InfluencePolicy
    clip_norm: Callable[[], float] | None = None
    name: str = "bound"

    def run(self, ctx: RoundContext) -> None:
        policy = self.policy if self.clip_norm is None else replace(self.policy, clip_norm=self.clip_norm())
        ctx.influence, ctx.contributions = bounded_contributions(policy, ctx.state.updates, ctx.open_delta)


def keep_model(bank: ModelBank, round_number: int, spec: tuple[TensorSpec, ...], owner: str,
               model: NamedArrays) -> Holding:  # fmt: skip
    """Write ``model``'s floats to the bank as ``owner``'s model after round ``round_number``, named by the
    fingerprint of the whole model (what the agent that gets it computes)."""
    return bank.writer(round_number, owner, spec, model).keep(flatten(float_part(model), spec))


@dataclass
class PlanStarts(Step):
    """The strategy's ``plan_starts``: whether the round's result is published, and what every agent starts
    the next round from; model-keeping strategies see the round's kept models and may keep new ones."""

    strategy: Strategy
    bank: ModelBank
    current: Callable[[], dict[str, Assignment]]
    rng: Callable[[], np.random.Generator]
    evaluator: Callable[[NamedArrays], dict[str, float]] | None = None
    release_std: Callable[[RoundContext], float] | None = None  # differential privacy: a released model's noise
    name: str = "plan-starts"

    def run(self, ctx: RoundContext) -> None:
        models = None
        if self.strategy.keeps_models:
            models = KeptModels(
                round=ctx.state.round, action=ctx.state.action, agents=[c.agent for c in ctx.contributions],
                kept=ctx.kept, exact=ctx.exact, current=self.current(), spec=ctx.float_spec,
                vector=self.bank.vector,
                writer=self.bank.new_models(ctx.state.round, ctx.float_spec, ctx.global_arrays),
                peers=lambda holdings: self.bank.peers(holdings, ctx.float_spec),
                rng=self.rng, evaluate=None if self.evaluator is None else (
                    lambda vector: self.evaluator(with_floats(ctx.global_arrays, vector, ctx.float_spec))),
                release=None if self.release_std is None else (lambda agent: self._release(ctx, agent)),
            )  # fmt: skip
        started = time.perf_counter()
        ctx.plan = self.strategy.plan_starts(models)
        ctx.aggregate_s += time.perf_counter() - started  # the strategy's time: DemLearn's clustering, say
        ctx.step_detail.update(ctx.plan.detail)
        if ctx.released and not ctx.plan.publish and ctx.result is not None:  # what the round shows: what left
            mean = np.zeros_like(ctx.result.global_vector, dtype=np.float32)  # one model in RAM, not all of them
            for holding in ctx.released.values():
                axpy(self.bank.vector(holding), mean, 1.0 / len(ctx.released))
            ctx.result = replace(ctx.result, global_vector=mean)

    def _release(self, ctx: RoundContext, agent: str) -> Holding:
        """``agent``'s kept model plus N(0, std²) on every float (``gaussian.release``), kept as ``+dp-<agent>``."""
        assert self.release_std is not None
        ctx.noise_std = self.release_std(ctx)
        vector = release(self.bank.vector(ctx.kept[agent]), ctx.noise_std, ctx.float_spec)
        ctx.released[agent] = keep_model(self.bank, ctx.state.round, ctx.float_spec, f"+dp-{agent}",
                                         with_floats(ctx.global_arrays, vector, ctx.float_spec))  # fmt: skip
        return ctx.released[agent]


@dataclass
class Aggregate(Step):
    """The strategy's new model; with ``average_only`` (differential privacy), only the average its
    server optimizer would step on, so the noise goes in before that step (``ServerStep``)."""

    strategy: Strategy
    average_only: bool = False
    name: str = "aggregate"

    def run(self, ctx: RoundContext) -> None:
        started = time.perf_counter()
        combine = self.strategy.average if self.average_only else self.strategy.aggregate
        ctx.result = combine(ctx.global_vector, ctx.contributions)
        ctx.aggregate_s = time.perf_counter() - started


@dataclass
class ServerStep(Step):
    """The server optimizer's step on the (noisy) average: post-processing under differential privacy;
    the new model must be finite (checked here, after the noise, so the verdict is free to publish)."""

    strategy: Strategy
    name: str = "server-step"

    def run(self, ctx: RoundContext) -> None:
        assert ctx.result is not None
        ctx.result = self.strategy.server_step(ctx.global_vector, ctx.result)
        if not np.isfinite(ctx.result.global_vector).all():  # e.g. noise on an absurd clip: checked after it
            raise RoundRejected("non-finite-model", offenders(ctx.contributions))
        ctx.candidate = with_floats(ctx.global_arrays, ctx.result.global_vector, ctx.float_spec)


@dataclass
class BoundChange(Step):
    """A published step at most ``bounds.change_multiple`` x the federation's recent committed steps (the first:
    the round's clip bound), shortened to that when longer (``flcore.change_bound``); ``change_norm`` in the
    round's ``metrics.aggregation`` is the step committed, ``change_shrunk`` the factor when it was shortened."""

    policy: InfluencePolicy
    history: ChangeHistory
    name: str = "bound-change"

    def run(self, ctx: RoundContext) -> None:
        assert ctx.result is not None and ctx.influence is not None and ctx.candidate is not None
        if not ctx.plan.publish:  # kept models have their own bound (KeepAgentModels' drift bound)
            return
        limit = self.history.limit(self.policy.change_multiple, ctx.influence.clip_bound)
        new, norm, factor = shrink_step(ctx.result.global_vector, ctx.global_vector, limit)
        ctx.step_detail["change_norm"] = round(norm, 6)
        if factor < 1:  # a step back towards a checked model keeps its invariants (convex in each value)
            ctx.result = replace(ctx.result, global_vector=new)
            ctx.candidate = with_floats(ctx.global_arrays, new, ctx.float_spec)
            ctx.step_detail.update(change_bound=round(limit, 6), change_shrunk=round(factor, 6))


@dataclass
class CheckModel(Step):
    """Every value finite, no negative running variance, and the change within the policy:
    ``bounds.max_change_norm`` when set, and the clip bound for strategies whose output is a convex
    combination of clipped deltas. Under differential privacy (``private``) only finiteness is checked:
    a refusal decided on the un-noised average would reveal something about it (a running variance
    that float32 rounding takes a hair below zero is repaired after the noise, ``AddNoise``)."""

    policy: InfluencePolicy
    bounded_by_clip: bool
    private: bool = False
    name: str = "check"

    def run(self, ctx: RoundContext) -> None:
        assert ctx.result is not None and ctx.influence is not None
        published = ctx.plan.publish  # else the result is only evaluated; kept models have their own bound
        limit = change_limit(self.policy, ctx.influence, self.bounded_by_clip) if published else math.inf
        try:  # the same invariants every accepted update met, unless private
            check_new_model(ctx.result.global_vector, ctx.global_vector, ctx.float_spec, limit=limit,
                            invariants=not self.private)  # fmt: skip
        except UpdateRejected as exc:
            raise RoundRejected(exc.reason, offenders(ctx.contributions)) from None
        ctx.candidate = with_floats(ctx.global_arrays, ctx.result.global_vector, ctx.float_spec)


@dataclass
class Evaluate(Step):
    """The candidate on the server's evaluation set: a non-finite score, or a collapse from the model in force's
    (``in_force``; ``flcore.change_bound.collapse`` at ``collapse_ratio``), rolls the round back."""

    evaluator: Callable[[NamedArrays], dict[str, float]]
    in_force: Callable[[], dict[str, float]] = dict
    collapse_ratio: float = 0.0
    name: str = "evaluate"

    def run(self, ctx: RoundContext) -> None:
        assert ctx.candidate is not None
        ctx.evaluation = self.evaluator(ctx.candidate)
        if not all(math.isfinite(v) for v in ctx.evaluation.values()):
            raise RoundRejected("non-finite-evaluation", offenders(ctx.contributions))
        if ctx.plan.publish and self.collapse_ratio > 0:
            before = self.in_force() or self.evaluator(ctx.global_arrays)  # the first round: the initial model
            if why := collapse(before, ctx.evaluation, self.collapse_ratio):
                raise RoundRejected(why, offenders(ctx.contributions))


class AgentsEvaluation(Step):
    """Partial aggregation (``server.share``): each agent's model is the shared global part plus its own
    private part, so the round's evaluation is the agents' own validation of those models (their
    ``local_eval``), averaged with the update weights; the global model alone would be meaningless."""

    name = "agents-evaluation"

    def run(self, ctx: RoundContext) -> None:
        reports = [(u.samples, u.local_eval) for u in ctx.state.on_time if u.local_eval]
        keys = set.intersection(*(set(e) for _, e in reports)) if reports else set()
        total = sum(w for w, _ in reports)
        # normalized weights first: claimed values are finite but may be huge, and w * value could overflow
        ctx.evaluation = {k: round(sum(w / total * e[k] for w, e in reports), 6) for k in sorted(keys)}
        ctx.step_detail["eval_source"] = f"agents' own validation ({len(reports)} agents)"


def run_pipeline(steps: list[Step], ctx: RoundContext) -> None:
    """Run the steps in order; any failure surfaces as ``RoundRejected``."""
    for step in steps:
        try:
            step.run(ctx)
        except RoundRejected:
            raise
        except Exception as exc:  # noqa: BLE001 - a failing step must roll the round back, not crash the server
            raise RoundRejected(f"internal-error in {step.name}: {type(exc).__name__}: {exc}") from exc
