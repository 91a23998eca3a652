"""Validation of a decrypted update before any strategy sees it (ARCHITECTURE.md, round step 3).

Checks, in order: safetensors structure, the update header, round and base version, tensor names,
shapes and dtypes against the global model, finite values, and the optional L2 norm bound. One BLAS
dot product gives both the norm and the finiteness check (any NaN/Inf makes it non-finite), so a
12.8 MB update costs one read. A rejected update never reaches the strategy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.linalg.blas import sdot

from models.serialization import SerializationError, float32_region
from models.weights import TensorSpec
from protocol.update import UpdateMeta, UpdateMetaError


class UpdateRejected(Exception):
    """An update failed validation; ``reason`` is short and goes to ``metrics.rejected``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ValidatedUpdate:
    meta: UpdateMeta
    delta: np.ndarray
    norm: float


def describe_spec_mismatch(got: tuple[TensorSpec, ...], expected: tuple[TensorSpec, ...]) -> str:
    got_by_name = {s.name: s for s in got}
    for spec in expected:
        other = got_by_name.get(spec.name)
        if other is None:
            return f"missing tensor {spec.name!r}"
        if other.shape != spec.shape:
            return f"shape of {spec.name} is {other.shape}, expected {spec.shape}"
    extra = sorted(set(got_by_name) - {s.name for s in expected})
    if extra:
        return f"unexpected tensor {extra[0]!r}"
    return "tensor order differs from the global model"


def validate_update(
    data: bytes | bytearray,
    *,
    expected_spec: tuple[TensorSpec, ...],
    round_number: int,
    model_version: int,
    max_norm: float = 0.0,
) -> ValidatedUpdate:
    """Parse and check one update; raise ``UpdateRejected`` with the reason on the first problem."""
    try:
        vector, spec, metadata = float32_region(data)
    except SerializationError as exc:
        raise UpdateRejected(f"malformed-update: {exc}") from None
    try:
        meta = UpdateMeta.from_metadata(metadata)
    except UpdateMetaError as exc:
        raise UpdateRejected(str(exc)) from None
    if meta.round != round_number:
        raise UpdateRejected(f"wrong-round: update for round {meta.round}, current is {round_number}")
    if meta.base_version != model_version:
        raise UpdateRejected(f"stale-base: trained on version {meta.base_version}, current is {model_version}")
    if tuple(spec) != tuple(expected_spec):
        raise UpdateRejected(f"wrong-tensors: {describe_spec_mismatch(tuple(spec), expected_spec)}")
    norm = math.sqrt(sdot(vector, vector)) if vector.size else 0.0
    if not math.isfinite(norm):
        raise UpdateRejected("non-finite-values: NaN or Inf in the delta")
    if max_norm > 0 and norm > max_norm:
        raise UpdateRejected(f"norm-too-large: {norm:.4g} > {max_norm:.4g}")
    return ValidatedUpdate(meta=meta, delta=vector, norm=norm)
