"""Structural validation of a decrypted update before its values are read (docs/architecture.md, step 3).

Checks, in order: safetensors structure, the update header, round and base version, the codec (the
round's), then tensor names, shapes and dtypes against the global model; an encoded update
(``protocol.codecs``) is decoded to float32 first, so every later check reads the same kind of delta.
The values themselves (finite, norm) are checked by ``flcore.onepass.scan`` in the same pass
that folds them, and ``check_invariants`` refuses an update that would leave the model invalid on its
own: a negative BatchNorm running variance (PyTorch's ``*.running_var``) makes every later evaluation
NaN. Honest training never produces one (it is an average of variances); a sign-flipped or rescaled
update easily does. Since clipping, averaging, medians and trimmed means all keep each value inside the
range of the valid inputs, an aggregate of valid updates is valid too. A rejected update never reaches
a strategy. ``check_values`` is the value half of accepting an update, shared by the server's accept path
(``broker_server.rounds.accept``) and a peer's (``agent.peer``): one function, so both refuse the same updates.
"""

from __future__ import annotations

import numpy as np

from flcore.bounds import InfluencePolicy
from flcore.onepass import Fold, NonFiniteUpdate, Scan, axpy, scan
from flcore.update import UpdateRejected
from models.weights import TensorRange, TensorSpec, ranges_of


def reason_kind(reason: str) -> str:
    """``norm-too-large: 3.2 > 1`` → ``norm-too-large``: a refusal's kind, without the values measured."""
    return reason.split(":", 1)[0]


MAX_REJECTIONS_LISTED = 200  # refusals one round's metrics list
MAX_REJECTIONS_PER_SENDER = 3  # of them, distinct kinds per sender


def worth_listing(reason: str, sender_reasons: list[str], listed: int) -> bool:
    """Whether a refusal goes into its round's metrics, which list ``listed`` already, ``sender_reasons`` of them
    its sender's: each kind once per sender, ``MAX_REJECTIONS_PER_SENDER`` per sender and ``MAX_REJECTIONS_LISTED``
    in all, so that a rogue's stream of refusals neither grows the metrics past what their readers take nor
    crowds out the others' (the refusals are still logged and counted)."""
    kind = reason_kind(reason)
    return (listed < MAX_REJECTIONS_LISTED and len(sender_reasons) < MAX_REJECTIONS_PER_SENDER
            and all(reason_kind(r) != kind for r in sender_reasons))  # fmt: skip


def positive_ranges(spec: tuple[TensorSpec, ...]) -> tuple[TensorRange, ...]:
    """The BatchNorm running variances of a model (they must not go negative), by state_dict name."""
    return ranges_of(spec, ("running_var",))


def check_invariants(delta: np.ndarray, global_vector: np.ndarray, ranges: tuple[TensorRange, ...]) -> None:
    """Refuse a delta that would make any running variance negative (or NaN) when applied. Zero is
    allowed: a channel whose input never varies decays its running variance to exactly 0 in float32."""
    for r in ranges:
        applied = global_vector[r.start : r.stop] + delta[r.start : r.stop]
        if not (applied >= 0).all():
            raise UpdateRejected(
                f"invalid-running-var: {r.name} would become negative (min {float(applied.min()):.3g})"
            )


def check_values(
    delta: np.ndarray,
    base_vector: np.ndarray,
    positive: tuple[TensorRange, ...],
    policy: InfluencePolicy,
    fold: Fold | None = None,
) -> Scan:
    """Every value finite, the L2 norm within ``policy.max_update_norm`` (when set) and the model's invariants
    kept, in one pass that also folds the delta into ``fold`` when its bounds allow; raise ``UpdateRejected``
    with the reason otherwise, leaving ``fold.into`` as it was."""
    try:
        result = scan(delta, fold)
    except NonFiniteUpdate as exc:
        raise UpdateRejected(f"non-finite-values: {exc}") from None
    folded = fold.weight if (fold is not None and result.folded) else 0.0
    try:
        if policy.max_update_norm > 0 and result.norm > policy.max_update_norm:
            raise UpdateRejected(f"norm-too-large: {result.norm:.4g} > {policy.max_update_norm:.4g}")
        check_invariants(delta, base_vector, positive)
    except UpdateRejected:
        if folded and fold is not None:
            axpy(delta, fold.into, -folded)  # leave the running sum as it was
        raise
    return result
