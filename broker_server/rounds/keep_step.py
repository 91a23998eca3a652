"""Model-keeping strategies' first step at the close: each agent's model after the round, kept in the server's
model store (``flcore.agent_models.ModelBank``), with the drift bound that holds those models near the global one.

An agent's model after the round is its start model plus its clipped delta (``models.weights.advanced``, as the
agent computes it), named by its fingerprint. Writing and fingerprinting it is most of the close's own work at
a large model (100 agents × 3.2M values: 1.28 GB written, then hashed), so it is done as each update is
accepted, while slower agents still train (``KeepAgentModels.keep_accepted``), and the close reuses it where
the round's clip left the update whole; a clipped update, a restarted server, an update folded late and every
update under differential privacy are kept at the close as before, with the same function, so either way the
same bits are kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from broker_server.rounds.pipeline import RoundContext, Step, keep_model
from flcore import blas
from flcore.agent_models import Holding, ModelBank
from flcore.bounds import InfluencePolicy, lower_median
from flcore.rounds import RoundState
from models.weights import NamedArrays, TensorSpec, advanced, unflatten, with_floats


@dataclass
class KeepAgentModels(Step):
    """For model-keeping strategies: each agent's model after the round kept in the bank; the strategy then
    sees those models (``Contribution.model``, and in ``plan_starts``).

    The clip bounds one round's step, not how far an agent's model drifts from the global one over the
    rounds between averages, and a drifted model is handed to a swap partner and averaged. So, unless
    ``bounds.clip = "off"``, a model further than ``clip_multiple`` × the lower median drift from the
    global model is pulled back to that distance (the agent then gets the server's copy, not its own)."""

    bank: ModelBank
    base_of: Callable[[str], np.ndarray]
    policy: InfluencePolicy
    private: bool = False  # differential privacy: no drift bound (a pull-back decided on un-noised distances)
    name: str = "keep-models"
    accepted: dict[str, tuple[tuple[int, int], Holding, float]] = field(default_factory=dict)  # agent → kept early

    def keep_accepted(self, state: RoundState, agent: str, delta: np.ndarray, global_arrays: NamedArrays,
                      global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:  # fmt: skip
        """Keep ``agent``'s model from its update just accepted into ``state``'s round, as the close would if
        the round's clip leaves the update whole (``run`` then takes it instead of keeping it again). Not under
        differential privacy, whose clip is set to bind: most of those models would be kept twice."""
        if self.private:
            return
        kept = self._keep(state.round, spec, global_vector, agent, self._advanced(agent, delta, global_arrays, spec))
        self.accepted[agent] = ((state.round, state.attempt), *kept)

    def run(self, ctx: RoundContext) -> None:
        drifts, this_round = [], (ctx.state.round, ctx.state.attempt)
        accepted, self.accepted = self.accepted, {}
        for c in ctx.contributions:
            early = accepted.get(c.agent)
            if c.scale == 1 and early is not None and early[0] == this_round:
                ctx.kept[c.agent], drift = early[1], early[2]
            else:
                step = c.delta if c.scale == 1 else c.delta * np.float32(c.scale)
                model = self._advanced(c.agent, step, ctx.global_arrays, ctx.float_spec)
                ctx.kept[c.agent], drift = self._keep(ctx.state.round, ctx.float_spec, ctx.global_vector, c.agent,
                                                      model)  # fmt: skip
            drifts.append(drift)
            if c.scale == 1:
                ctx.exact.add(c.agent)
        if self.policy.clip != "off" and drifts and not self.private:
            bound = max(1.0, self.policy.clip_multiple) * lower_median(np.array(drifts))
            capped = [(c.agent, d) for c, d in zip(ctx.contributions, drifts, strict=True) if d > bound]
            for agent, drift in capped:
                held = self.bank.vector(ctx.kept[agent])
                pulled = ctx.global_vector + (held - ctx.global_vector) * np.float32(bound / drift)
                ctx.kept[agent], _ = self._keep(ctx.state.round, ctx.float_spec, ctx.global_vector, agent,
                                                with_floats(ctx.global_arrays, pulled, ctx.float_spec))  # fmt: skip
                ctx.exact.discard(agent)
            ctx.step_detail.update(drift_bound=round(bound, 6), drift_capped=[agent for agent, _ in capped])
        ctx.contributions = [replace(c, model=self.bank.vector(ctx.kept[c.agent])) for c in ctx.contributions]

    def _advanced(self, agent: str, step: np.ndarray, global_arrays: NamedArrays,
                  spec: tuple[TensorSpec, ...]) -> NamedArrays:  # fmt: skip
        """``agent``'s start model plus ``step``: its model after the round."""
        return advanced(with_floats(global_arrays, self.base_of(agent), spec), unflatten(step, spec))

    def _keep(self, round_number: int, spec: tuple[TensorSpec, ...], global_vector: np.ndarray, agent: str,
              model: NamedArrays) -> tuple[Holding, float]:  # fmt: skip
        """Write ``agent``'s model to the bank; returns its holding and its distance from the global model."""
        holding = keep_model(self.bank, round_number, spec, agent, model)
        drift = self.bank.vector(holding) - global_vector
        return holding, math.sqrt(float(blas.sdot(drift, drift)))
