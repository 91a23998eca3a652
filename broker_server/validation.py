"""Structural validation of a decrypted update before its values are read (docs/architecture.md, step 3).

Checks, in order: safetensors structure, the update header, round and base version, the codec (the
round's), then tensor names, shapes and dtypes against the global model; an encoded update
(``protocol.codecs``) is decoded to float32 first, so every later check reads the same kind of delta.
The values themselves (finite, norm) are checked by ``broker_server.onepass.scan`` in the same pass
that folds them, and ``check_invariants`` refuses an update that would leave the model invalid on its
own: a negative BatchNorm running variance (PyTorch's ``*.running_var``) makes every later evaluation
NaN. Honest training never produces one (it is an average of variances); a sign-flipped or rescaled
update easily does. Since clipping, averaging, medians and trimmed means all keep each value inside the
range of the valid inputs, an aggregate of valid updates is valid too. A rejected update never reaches
a strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.serialization import SerializationError, dumps, float32_region, loads, read_header
from models.weights import TensorRange, TensorSpec, flatten, ranges_of, unflatten
from protocol.codecs import FP32, Codec, CodecError, decode
from protocol.update import UpdateMeta, UpdateMetaError


class UpdateRejected(Exception):
    """An update was refused; ``reason`` is short and goes to ``metrics.rejected``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NotForThisRound(UpdateRejected):
    """Refused by the round's gates (no round, another round, not selected, already accepted): says
    nothing about the sender's update for this round, which it may still send."""


@dataclass(frozen=True)
class ParsedUpdate:
    meta: UpdateMeta
    delta: np.ndarray  # float32 in the model's float layout: a zero-copy view into the received bytes under fp32
    stored: bytes | bytearray | memoryview  # what the update store keeps: float32 safetensors, like an fp32 update


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
        return f"unexpected tensor {extra[0][:64]!r}"
    return "tensor order differs from the global model"


def parse_update(
    data: bytes | bytearray | memoryview,
    *,
    expected_spec: tuple[TensorSpec, ...],
    round_number: int,
    model_version: int,
    base_sha256: str = "",
    codec: Codec = FP32,
) -> ParsedUpdate:
    """Parse and check one update's structure; raise ``UpdateRejected`` with the reason on the first problem."""
    try:
        header = read_header(data)
    except SerializationError as exc:
        raise UpdateRejected(f"malformed-update: {exc}") from None
    try:
        meta = UpdateMeta.from_metadata(header.metadata)
    except UpdateMetaError as exc:
        raise UpdateRejected(str(exc)) from None
    if meta.round != round_number:
        raise UpdateRejected(f"wrong-round: update for round {meta.round}, current is {round_number}")
    if meta.base_version != model_version:
        raise UpdateRejected(f"stale-base: trained on version {meta.base_version}, current is {model_version}")
    if meta.base_sha256 != base_sha256:
        said = f"model {base_sha256[:12]}" if base_sha256 else "the global model"
        raise UpdateRejected(f"wrong-base: trained from {meta.base_sha256[:12] or 'the global model'}, not {said}")
    if meta.codec != str(codec):
        raise UpdateRejected(f"wrong-codec: encoded as {meta.codec}, the round asks for {codec}")
    if codec != FP32:
        try:
            delta = flatten(decode(loads(data, header=header)[0], codec, expected_spec), expected_spec)
        except CodecError as exc:
            raise UpdateRejected(f"bad-encoding: {exc}") from None
        return ParsedUpdate(meta=meta, delta=delta, stored=dumps(unflatten(delta, expected_spec)))
    try:
        vector, spec, _ = float32_region(data, header)
    except SerializationError as exc:
        raise UpdateRejected(f"malformed-update: {exc}") from None
    if tuple(spec) != tuple(expected_spec):
        raise UpdateRejected(f"wrong-tensors: {describe_spec_mismatch(tuple(spec), expected_spec)}")
    return ParsedUpdate(meta=meta, delta=vector, stored=data)
