"""One round's peer updates: each checked exactly as the server checks an agent's (structure with
``flcore.update.parse_update``, values and invariants with ``flcore.validation.check_values``), kept
until the round aggregates with the shared bounds and strategy (``flcore.aggregation``).

A peer sends its trained model in the update format (``flcore.update.encode_model``: its change over zero,
with the fingerprint of the model it trained from), and each receiver takes the change from its own model. When
every peer starts the round from the same model m_r, that change is bit for bit the sender's
Δ = trained − m_r, and every peer aggregates the round's updates in the order of the senders' ids, so
they compute the same model, bit for bit: the centralized FedAvg of the same updates. After a round some
peers closed on a threshold, the peers' models differ; a change over the receiver's own model then also
pulls the peers' models together (SmartFed averages models), where a delta over the sender's model would
let them drift apart for good. The round's detail names such senders under ``other_base``. An update built on a
provably old model is refused ``stale-base`` (``agent.peer.stale``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from agent.peer.stale import StaleGuard, content_digest
from flcore.aggregation import bounded_contributions, change_limit, check_new_model
from flcore.bounds import MIN_REFERENCE, InfluencePolicy
from flcore.change_bound import ChangeHistory, collapse, shrink_step
from flcore.rounds import UpdateRecord
from flcore.screening import screen
from flcore.strategies.base import Strategy
from flcore.update import UpdateMeta, UpdateMetaError, UpdateRejected, float_layout, parse_update
from flcore.validation import check_values, positive_ranges, worth_listing
from models.serialization import SerializationError, read_header
from models.weights import NamedArrays, fingerprint, flatten, float_part, spec_of, with_floats
from protocol.transfer import MiB, TransferLimits


@dataclass
class PeerUpdate:
    record: UpdateRecord
    delta: np.ndarray  # float32, this process's own copy
    base_sha256: str


@dataclass
class RoundGuards:
    """What outlasts a peer's rounds to guard the next: its validation ``evaluate``, its committed steps and the
    evaluation of the model it holds (by identity: a catch-up or elected model has none until evaluated)."""

    evaluate: Callable[[NamedArrays], dict[str, float]]
    history: ChangeHistory = field(default_factory=ChangeHistory)
    model: NamedArrays | None = None
    evaluation: dict[str, float] = field(default_factory=dict)

    def evaluation_of(self, model: NamedArrays) -> dict[str, float]:
        return self.evaluation if model is self.model else {}

    def note(self, model: NamedArrays, evaluation: dict[str, float]) -> None:
        self.model, self.evaluation = model, evaluation


@dataclass
class RoundCollector:
    """The updates of round ``round`` over this peer's model ``model`` (version ``round - 1``)."""

    round: int
    model: NamedArrays
    policy: InfluencePolicy
    me: str = ""  # this peer: its own update is the bounds' reference in a round of fewer than three
    guard: StaleGuard | None = None  # what this peer held and saw in earlier rounds: this round starts now
    updates: dict[str, PeerUpdate] = field(default_factory=dict)
    rejected: list[dict[str, str]] = field(default_factory=list)  # as ``worth_listing`` allows
    refused: int = 0  # every refusal this round

    def __post_init__(self) -> None:
        self.spec, self.vector = float_layout(self.model)
        self.positive = positive_ranges(self.spec)
        self.sha256 = fingerprint(self.model)
        if self.guard is not None:
            self.guard.start(self.round, self.sha256, content_digest(self.vector))

    def accept(self, sender: str, data: bytes | bytearray | memoryview, wire_bytes: int,
               late_weight: float = 0.0) -> PeerUpdate:  # fmt: skip
        """Check and keep ``sender``'s update, or raise ``UpdateRejected`` (recorded in ``rejected``); with
        ``late_weight``, its late update of the round before, kept as ``sender@round`` (``flcore.late``)."""
        try:
            return self._accept(sender, data, wire_bytes, late_weight)
        except UpdateRejected as exc:
            self._refuse(sender, exc.reason)
            raise

    def _refuse(self, peer: str, reason: str) -> None:
        self.refused += 1
        if worth_listing(reason, [e["reason"] for e in self.rejected if e["peer"] == peer], len(self.rejected)):
            self.rejected.append({"peer": peer, "reason": reason})

    def _accept(self, sender: str, data: bytes | bytearray | memoryview, wire_bytes: int,
                late_weight: float) -> PeerUpdate:  # fmt: skip
        late_from = self.round - 1 if late_weight else 0
        key = f"{sender}@{late_from}" if late_from else sender
        if key in self.updates:
            raise UpdateRejected("duplicate")
        parsed = parse_update(data, expected_spec=self.spec, round_number=late_from or self.round,
                              model_version=(late_from or self.round) - 1, base_sha256=claimed_base(data))  # fmt: skip
        meta, digest = parsed.meta, content_digest(parsed.delta)
        if self.guard is not None:
            check = self.guard.late_refusal if late_from else self.guard.refusal
            if stale := check(sender, meta.base_sha256, digest):
                raise UpdateRejected(stale)
        change = np.subtract(parsed.delta, self.vector, dtype=np.float32)  # the sender's model, from this peer's
        scan = check_values(change, self.vector, self.positive, self.policy)
        record = UpdateRecord(agent=sender, samples=meta.weight, loss=meta.loss, norm=scan.norm, wire_bytes=wire_bytes,
                              local_eval=meta.local_eval, start_eval=meta.start_eval,
                              trained_eval=meta.trained_eval, late_from=late_from,
                              discount=late_weight or 1.0)  # fmt: skip
        update = PeerUpdate(record, change, meta.base_sha256)
        self.updates[key] = update
        if self.guard is not None:
            self.guard.note(sender, meta.base_sha256, digest, late=bool(late_from))
        return update

    @property
    def on_time(self) -> list[str]:
        """The senders of this round's own updates (not late ones of the round before)."""
        return sorted(k for k, u in self.updates.items() if not u.record.late_from)

    def _round_policy(self) -> InfluencePolicy:
        """The bounds, with this peer's own update as their reference when the round has fewer than three: the
        lower median of two is the smaller, one sender's word, and a member whose zero update always came first
        (threshold 2) clipped every peer's own update to nothing, every round."""
        own, policy = self.updates.get(self.me), self.policy
        if own is None or len(self.updates) >= MIN_REFERENCE:
            return policy
        if policy.clip == "adaptive" and own.record.norm > 0:
            policy = replace(policy, clip="fixed", clip_norm=policy.clip_multiple * own.record.norm)
        if policy.sample_multiple > 0:
            cap = int(policy.sample_multiple * own.record.samples)
            policy = replace(policy, sample_multiple=0, max_samples=min(policy.max_samples or cap, cap))
        return policy

    def drop(self, peer: str, reason: str) -> None:
        """Forget ``peer``'s update (revoked during the round)."""
        if self.updates.pop(peer, None) is not None:
            self._refuse(peer, reason)

    def aggregate(self, strategy: Strategy, guards: RoundGuards) -> tuple[NamedArrays, dict[str, Any]]:
        """The next model: this one plus the strategy's aggregate of the bounded (and screened) updates, its step
        held to the recent ones; ``UpdateRejected`` when the result must not replace it (non-finite, invalid
        running variance, moved too far, its evaluation collapsed). ``guards`` then holds its evaluation."""
        peers = sorted(self.updates)
        records = [self.updates[p].record for p in peers]
        policy = self._round_policy()
        influence, contributions = bounded_contributions(policy, records, lambda p: self.updates[p].delta)
        in_force = guards.evaluation_of(self.model)
        dropped = screen(contributions, self.model, self.vector, self.spec, guards.evaluate, in_force,
                         policy.screen_below)  # fmt: skip
        kept = [c for i, c in enumerate(contributions) if i not in dropped]
        strategy.begin(self.vector, self.spec)
        result = strategy.aggregate(self.vector, kept)
        check_new_model(result.global_vector, self.vector, self.spec,
                        limit=change_limit(policy, influence, strategy.bounded_by_clip))  # fmt: skip
        limit = guards.history.limit(policy.change_multiple, influence.clip_bound)
        vector, step, factor = shrink_step(result.global_vector, self.vector, limit)
        model = with_floats(self.model, vector, self.spec)
        evaluation = guards.evaluate(model)
        if not all(math.isfinite(v) for v in evaluation.values()):
            raise UpdateRejected("non-finite-evaluation")
        if why := collapse(in_force, evaluation, policy.collapse_ratio):
            raise UpdateRejected(why)
        strategy.on_commit(replace(result, global_vector=vector))
        guards.history.note(step)
        guards.note(model, evaluation)
        norms = np.array([r.norm for r in records])
        claimed = np.array([r.samples for r in records], np.float64)
        detail = {**influence.describe(peers, claimed, norms), **result.detail, "change_norm": round(step, 6)}
        if folded := [p for p in peers if self.updates[p].record.late_from]:
            detail["folded_late"] = folded
        if dropped:
            detail["screened"] = {contributions[i].agent: why for i, why in sorted(dropped.items())}
        if factor < 1:
            detail.update(change_bound=round(limit, 6), change_shrunk=round(factor, 6))
        if other := [p for p in peers if self.updates[p].base_sha256 != self.sha256]:
            detail["other_base"] = other
        return model, detail


def claimed_base(data: bytes | bytearray | memoryview) -> str:
    """The start model an update says it was trained from ("" when its header is unreadable: ``parse_update``
    then refuses it with the reason)."""
    try:
        return UpdateMeta.from_metadata(read_header(data).metadata).base_sha256
    except (SerializationError, UpdateMetaError):
        return ""


def same_layout(model: NamedArrays, other: NamedArrays) -> bool:
    """Whether two models have the same tensors (names, dtypes, shapes), in whatever order."""
    return {s.name: s for s in spec_of(model)} == {s.name: s for s in spec_of(other)}


def model_refusal(model: NamedArrays, own: NamedArrays, round_number: int, last_round: int) -> str:
    """Why a member's ``peer-model`` (a catch-up model or the elected one, round ``last_round``) is refused,
    "" if it is not: a joiner adopts a catch-up model whole, so it must pass what the server asks of a new global
    model (``check_new_model``): finite, its change from the peer's own model too (values so large that its
    norm overflows would have every honest update refused after it), and the model's invariants kept."""
    if not same_layout(model, own):
        return "wrong-tensors"
    if not 1 <= round_number <= last_round:
        return f"bad-round: {round_number}"
    spec = spec_of(float_part(own))
    try:
        check_new_model(flatten(float_part(model), spec), flatten(float_part(own), spec), spec)
    except UpdateRejected as exc:
        return exc.reason
    return ""


def coordinate_median(models: list[NamedArrays]) -> NamedArrays:
    """A late joiner's start model from members' models (of one layout, ``same_layout``): the coordinate-wise
    median of their floating tensors (one hostile member cannot pick it when there are 3 or more), the other
    entries of the first."""
    first = models[0]
    spec = spec_of(float_part(first))
    stacked = np.stack([flatten(float_part(m), spec) for m in models])
    return with_floats(first, np.median(stacked, axis=0).astype(np.float32), spec)


def transfer_limits(model: NamedArrays) -> TransferLimits:
    """What a peer accepts from each member: nothing a peer sends (an update in fp32, or a whole model) is much
    larger than the shared model itself, so a transfer may be twice its size plus 1 MiB of header, and a sender
    may hold two such transfers half-received (an update and a model); all members together, 2 GiB (as before).
    A hostile member then holds that much of a peer's memory at most, never the quota the others need."""
    largest = 2 * sum(a.nbytes for a in model.values()) + MiB
    return TransferLimits(max_bytes=largest, max_partial_per_sender=2, max_pending_bytes_per_sender=2 * largest + MiB,
                          max_pending_bytes=max(2048 * MiB, 8 * largest))  # fmt: skip
