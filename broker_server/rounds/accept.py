"""Accepting one update into the open round: who may send, what it must look like, and what it costs.

In order: the round gates (a round is open, the update is for it, the sender was selected and has not
been accepted yet), the structure (``flcore.update.parse_update``, which decodes an encoded update), then
one pass over the values (``flcore.validation.check_values``, as a peer checks them: finite, L2 norm,
folded into a streaming strategy when the bounds known so far allow it), the outright norm limit, the
model's invariants (no negative running variance), and finally the update is written to the update store
before the round state records it. A refusal raises ``UpdateRejected`` and leaves the round exactly
as it was (a fold already made is subtracted again). A late update of the round before (``flcore.late``) passes
the same checks against the model it was trained from, and is stored, as the change from the model in force to
its model (asynchronous rounds: as its own change, its BatchNorm statistics as its model's), and recorded as
``agent@round``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from broker_server.rounds.update_store import UpdateStore
from flcore import blas
from flcore.bounds import InfluencePolicy, tentative
from flcore.late import late_refusal
from flcore.onepass import axpy
from flcore.rounds import RoundState, UpdateRecord
from flcore.staleness import Staleness
from flcore.strategies.base import Strategy
from flcore.update import MAX_LOCAL_EVAL, NotForThisRound, UpdateMeta, parse_update
from flcore.validation import check_values
from models.serialization import dumps
from models.weights import TensorRange, TensorSpec, unflatten
from protocol.codecs import FP32, Codec, encode
from protocol.transfer import Completed


@dataclass(frozen=True)
class RoundInputs:
    """What an update is checked against: the model its sender was told to start from (the global
    model, or with ``base_sha256`` set, the agent's own or its swap partner's)."""

    spec: tuple[TensorSpec, ...]
    model_version: int
    base_vector: np.ndarray
    positive: tuple[TensorRange, ...] = ()
    base_sha256: str = ""
    next_round: int = 0  # the round the server opens next (an update for an earlier one is late)
    codec: Codec = FP32  # how the round asked agents to encode updates
    late: LateWindows | None = None  # closed rounds whose late updates are folded in (None: refused)
    current: np.ndarray | None = None  # a late update's: the model in force, which its change is taken over
    staleness: int = 0  # a late update's: versions published since the one it was trained from
    # asynchronous rounds: a late update joins as its change (FedBuff), but these tensors (BatchNorm's running
    # statistics, estimates rather than weights) as its model's, so they stay valid
    as_model: tuple[TensorRange, ...] | None = None


HEADER_SLACK = 64 << 10  # room for an update's safetensors header beyond the model's own


def largest_update_bytes(float_spec: tuple[TensorSpec, ...], codec: Codec) -> int:
    """The largest a valid update can be: the model's float tensors as float32 or in the round's codec
    (whichever is larger, so an update in the wrong codec is still refused by name), plus a header."""
    local_eval = {f"{i:x}".ljust(32, "x"): -1e300 for i in range(MAX_LOCAL_EVAL)}
    meta = UpdateMeta(round=2**31, base_version=2**31, samples=2**53, loss=-1e300, local_eval=local_eval,
                      codec=str(codec)).to_metadata()  # fmt: skip
    zeros = {s.name: np.zeros(s.shape, np.float32) for s in float_spec}
    return max(len(dumps(encode(zeros, c), metadata=meta)) for c in (FP32, codec)) + HEADER_SLACK


@dataclass(frozen=True)
class LateWindow:
    """A closed round, as a late update of it is checked (``flcore.late``): its number, the model version it was
    announced with, and the selected agents it closed without (their update may still be folded in). Checkpointed
    with the round's close."""

    round: int = 0
    version: int = 0
    owed: tuple[str, ...] = ()
    asked_at: float = 0.0  # when the round last asked an agent (a status heard since answers it)

    def welcomes(self, agent: str, round_number: int) -> bool:
        return round_number == self.round and agent in self.owed

    def to_dict(self) -> dict:
        return {"round": self.round, "version": self.version, "owed": list(self.owed), "asked_at": self.asked_at}

    @classmethod
    def from_dict(cls, data: dict | None) -> LateWindow:
        data = data or {}
        return cls(int(data.get("round", 0)), int(data.get("version", 0)), tuple(data.get("owed", ())),
                   float(data.get("asked_at", 0.0)))  # fmt: skip


@dataclass(frozen=True)
class LateWindows:
    """The closed rounds whose late updates are still folded in, and their weight: in synchronous rounds the round
    just before (``flcore.late``); in asynchronous ones every round whose model is at most ``max_staleness``
    versions behind ``version``, the model in force (``flcore.staleness``). ``max_staleness`` 0: synchronous;
    ``folding`` off (``strategy.late_weight = 0``): the windows only tell a late update from a duplicate."""

    windows: tuple[LateWindow, ...] = ()
    version: int = 0
    staleness: Staleness = Staleness()
    max_staleness: int = 0
    folding: bool = True

    def find(self, agent: str, round_number: int) -> LateWindow | None:
        """The window that folds ``agent``'s update for ``round_number`` in, if one does."""
        if not self.folding:
            return None
        return next((w for w in self.windows if w.welcomes(agent, round_number)), None)

    def welcomes(self, agent: str, round_number: int) -> bool:
        return self.find(agent, round_number) is not None

    def owed(self) -> list[str]:
        """Agents whose late update is still welcome (each agent trains one round at a time)."""
        return sorted({agent for w in self.windows for agent in w.owed}) if self.folding else []

    def refusal(self, agent: str, round_number: int, current: int) -> str:
        """Why an update of ``agent`` for ``round_number``, before the ``current`` round, is refused ("": folded).
        ``late`` and ``stale`` name a trained update lost (``metrics.wasted``, as ``one-per-buffer`` does);
        ``not-owed`` one its round had counted already (a copy re-sent across a restart) or never asked for."""
        window = next((w for w in self.windows if w.round == round_number), None)
        if window is not None and agent not in window.owed:
            return f"not-owed: round {round_number} closed having counted {agent}'s update, or without asking for one"
        if not self.max_staleness:
            return late_refusal(round_number, current, folding=self.folding, owed=window is not None)
        if window is not None:
            return ""
        if self.windows and round_number < min(w.round for w in self.windows):
            return (f"stale: round {round_number}'s model is more than {self.max_staleness} versions behind the "
                    f"current {self.version} (rounds.max_staleness = {self.max_staleness})")  # fmt: skip
        return f"late: round {round_number} is closed, current is {current}"


def check_gates(state: RoundState | None, agent: str, round_number: int, next_round: int,
                late: LateWindows | None = None) -> int:  # fmt: skip
    """0 if this update may join the open round as its own; the round it was trained for if it joins as a late
    update of a closed round (``late``: the windows, ``flcore.late``; None: every late update is refused).
    ``next_round`` is the round the server opens next; ``NotForThisRound`` says why neither."""
    current = state.round if state is not None else next_round
    if round_number < current:  # e.g. after the round closed at its threshold
        late = late if late is not None else LateWindows(folding=False)
        if why := late.refusal(agent, round_number, current):
            raise NotForThisRound(why)
        if state is None:  # between two rounds: the daemon holds it for the next
            raise NotForThisRound(f"not-yet: round {current} is not open")
        if f"{agent}@{round_number}" in (u.key for u in state.updates) or agent in state.revoked:
            raise NotForThisRound("duplicate" if agent not in state.revoked else "revoked: its enrolment was withdrawn")
        if late.max_staleness and any(u.agent == agent for u in state.updates):
            raise NotForThisRound("one-per-buffer: one update per agent in a buffer (its newer one is in already)")
        return round_number
    if state is None:
        raise NotForThisRound("no-round-open")
    if round_number != state.round:
        raise NotForThisRound(f"wrong-round: transfer for round {round_number}, current is {state.round}")
    if agent not in state.selected:
        raise NotForThisRound("not-selected")
    if state.action == "local":  # model swapping: agents train on and upload nothing (``local_rounds``)
        raise NotForThisRound(f"not-expected: round {state.round} is a local round (nothing is uploaded)")
    if agent in state.revoked:  # an update completed just before its revocation, say
        raise NotForThisRound("revoked: its enrolment was withdrawn during the round")
    if agent in state.accepted:
        raise NotForThisRound("duplicate")
    if late is not None and late.max_staleness and any(u.agent == agent for u in state.updates):
        raise NotForThisRound("one-per-buffer: one update per agent in a buffer (its late one is in already)")
    return 0


def accept_update(
    completed: Completed,
    state: RoundState | None,
    inputs: RoundInputs,
    *,
    policy: InfluencePolicy,
    strategy: Strategy,
    store: UpdateStore,
) -> UpdateRecord:
    """Check, fold and store one update; append and return its record, or raise ``UpdateRejected``."""
    agent = completed.manifest.sender
    late_from = check_gates(state, agent, completed.manifest.round, inputs.next_round, inputs.late)
    assert state is not None  # the gates passed
    parsed = parse_update(
        completed.data,
        expected_spec=inputs.spec,
        round_number=late_from or state.round,
        model_version=inputs.model_version,
        base_sha256=inputs.base_sha256,
        codec=inputs.codec,
    )
    bounds = tentative(
        policy,
        np.array([u.norm for u in state.updates]),
        np.array([u.samples for u in state.updates], np.float64),
        parsed.meta.weight,
    )
    fold = strategy.fold_plan(bounds) if strategy.fold_on_accept and not late_from else None
    result = check_values(parsed.delta, inputs.base_vector, inputs.positive, policy, fold)
    folded = fold.weight if (fold is not None and result.folded) else 0.0
    stored, norm = parsed.stored, result.norm
    if late_from and inputs.current is not None:  # its model, as a change over the model in force (flcore.late)
        if inputs.as_model is None:
            change = np.add(parsed.delta, inputs.base_vector - inputs.current, dtype=np.float32)
        else:  # its change, but the ``as_model`` tensors as its model's
            change = np.array(parsed.delta, np.float32)
            for r in inputs.as_model:
                change[r.start:r.stop] += inputs.base_vector[r.start:r.stop] - inputs.current[r.start:r.stop]
        stored, norm = dumps(unflatten(change, inputs.spec)), math.sqrt(float(blas.sdot(change, change)))
    record = UpdateRecord(
        agent=agent,
        samples=parsed.meta.weight,
        loss=parsed.meta.loss,
        norm=norm,
        wire_bytes=completed.wire_bytes,
        folded=folded,
        local_epsilon=parsed.meta.local_epsilon,
        local_eval=parsed.meta.local_eval,
        start_eval=parsed.meta.start_eval,
        trained_eval=parsed.meta.trained_eval,
        late_from=late_from,
        discount=inputs.late.staleness.weight(inputs.staleness) if late_from and inputs.late else 1.0,
        staleness=inputs.staleness if late_from else 0,
    )
    try:
        store.put(state.round, record.key, stored)
    except BaseException:
        if folded and fold is not None:
            axpy(parsed.delta, fold.into, -folded)  # leave the running sum as it was
        raise
    state.updates.append(record)
    return record
