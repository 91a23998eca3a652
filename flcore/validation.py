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
a strategy.
"""

from __future__ import annotations

import numpy as np

from flcore.update import UpdateRejected
from models.weights import TensorRange, TensorSpec, ranges_of


def reason_kind(reason: str) -> str:
    """``norm-too-large: 3.2 > 1`` → ``norm-too-large``: a refusal's kind, without the values measured."""
    return reason.split(":", 1)[0]


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
