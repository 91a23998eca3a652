"""Update codecs ("thin links"): how an agent's float32 change shrinks before it is sealed, and how the
server turns it back into float32 before any check (finite, norm, shapes) runs.

The server's ``server.codec`` names one; the signed round task carries it and each update's sealed
``UpdateMeta.codec`` repeats it. ``fp32`` is the identity: the update is the named float32 change and the
server reads it zero-copy. The others put a few flat arrays under fixed names starting with ``@`` (no
model tensor name is ever used, so none can collide), over the change's tensors taken in name order:

- ``@dense``, float32: BatchNorm running statistics, exact under every codec. They are averaged
  statistics, not gradients, and few; rounded or dropped, a small running variance can come out
  negative, which the server refuses (``validation.check_invariants``), and error feedback would carry
  stale statistics into later rounds.
- ``fp16``: ``@values`` float16 (clipped to float16's range, so a value never becomes infinite).
- ``int8`` / ``int8:channel``: ``@values`` int8 and ``@scales`` float32, one per tensor, or one per
  output channel (axis 0) of tensors with ndim >= 2; a value is ``q * scale``, within ``scale / 2``.
- ``topk:FRACTION``: ``@indices`` int32, strictly increasing, and ``@values`` float32: the
  ``round(FRACTION * n)`` largest magnitudes of the n coded values as one vector. Global rather than per
  tensor: the budget goes where the change is, instead of a fixed share of every tensor (a 10-value
  bias would get 0 or 1 value at 1 %, a barely changed layer as many as a busy one); what a tensor does
  not send stays in the agent's residual until it is large enough. int32 indices reach 2**31 values,
  far beyond any model an agent trains (YOLO11x: 57M).

``compress`` is what the agent calls; with an ``ErrorFeedback`` it keeps the unsent remainder of
top-k changes on disk (Stich et al. 2018, "Sparsified SGD with memory"). Pure numpy: this module
must never import torch or ``models`` (``protocol`` is the wire contract both daemons import).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from common.files import atomic_write

NamedArrays = dict[str, np.ndarray]
Shapes = tuple[tuple[str, tuple[int, ...]], ...]

RUNNING_STATISTICS = ("running_mean", "running_var")  # = models.weights.RUNNING_STATISTICS (a test pins it)
DENSE, VALUES, SCALES, INDICES = "@dense", "@values", "@scales", "@indices"
CHOICES = "fp32, fp16, int8, int8:channel or topk:FRACTION (0 < FRACTION <= 1, e.g. topk:0.01)"
FP16_MAX = float(np.finfo(np.float16).max)
RESIDUAL_FORMAT = "skyfed.residual/1"


class CodecError(ValueError):
    """A codec name that is not one, or a payload that does not decode to the model; says why, briefly."""


class TensorShape(Protocol):  # models.weights.TensorSpec is one
    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Codec:
    kind: str = "fp32"  # fp32 | fp16 | int8 | topk
    per_channel: bool = False  # int8: one scale per output channel
    fraction: float = 1.0  # topk: the share of values sent

    @classmethod
    def parse(cls, text: str) -> Codec:
        kind, _, arg = text.partition(":")
        if text in ("fp32", "fp16", "int8"):
            return cls(kind)
        if text == "int8:channel":
            return cls("int8", per_channel=True)
        if kind == "topk":
            try:
                fraction = float(arg)
            except ValueError:
                fraction = math.nan
            if 0 < fraction <= 1:
                return cls("topk", fraction=fraction)
        raise CodecError(f"unknown codec {text[:40]!r}; choose {CHOICES}")

    def __str__(self) -> str:
        if self.kind == "topk":
            return f"topk:{self.fraction!r}"
        return "int8:channel" if self.per_channel else self.kind

    @property
    def feedback(self) -> bool:
        """Whether ``compress`` carries the unsent remainder into the next round: top-k only. Without it
        top-k ended 4.4 points lower on 2 labels per agent; int8 gained nothing measurable from it
        (docs/results/codecs.md), and it costs a model-sized durable write per round on the agent."""
        return self.kind == "topk"


FP32 = Codec()


def _split(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> tuple[Shapes, Shapes]:
    """(dense, coded): the running statistics and the other tensors, each in name order."""
    ordered = sorted(shapes)
    dense = tuple(s for s in ordered if s[0].endswith(RUNNING_STATISTICS))
    return dense, tuple(s for s in ordered if not s[0].endswith(RUNNING_STATISTICS))


def _flat(arrays: Mapping[str, np.ndarray], shapes: Shapes) -> np.ndarray:
    parts = [np.asarray(arrays[name], np.float32).reshape(-1) for name, _ in shapes]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _cut(vector: np.ndarray, shapes: Shapes) -> NamedArrays:
    out, offset = {}, 0
    for name, shape in shapes:
        size = math.prod(shape)
        out[name] = vector[offset : offset + size].reshape(shape)
        offset += size
    return out


def _size(shapes: Shapes) -> int:
    return sum(math.prod(shape) for _, shape in shapes)


def _row_lengths(coded: Shapes, per_channel: bool) -> np.ndarray:
    """How many values share each int8 scale: a whole tensor, or one output channel of it."""
    lengths: list[int] = []
    for _, shape in coded:
        if per_channel and len(shape) >= 2:
            lengths += [math.prod(shape[1:])] * shape[0]
        else:
            lengths.append(math.prod(shape))
    return np.array(lengths, np.int64)


def top_count(n: int, fraction: float) -> int:
    """How many of ``n`` values top-k sends (at least one when there is one)."""
    return min(n, max(1, round(fraction * n)))


def encode(change: Mapping[str, np.ndarray], codec: Codec) -> NamedArrays:
    """The arrays to serialize for ``change`` (float deltas as ``models.weights.delta`` makes them)."""
    if codec.kind == "fp32":
        return {name: np.asarray(a, np.float32) for name, a in change.items()}
    dense, coded = _split((name, a.shape) for name, a in change.items())
    values = _flat(change, coded)
    payload = {DENSE: _flat(change, dense)}
    if codec.kind == "fp16":
        payload[VALUES] = np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16)
    elif codec.kind == "int8":
        lengths = _row_lengths(coded, codec.per_channel)
        scales = np.zeros(lengths.size, np.float32)
        if values.size:
            rows = lengths > 0
            scales[rows] = np.maximum.reduceat(np.abs(values), (np.cumsum(lengths) - lengths)[rows]) / np.float32(127)
        each = np.repeat(scales, lengths)
        quantized = np.rint(values / np.where(each > 0, each, np.float32(1)))
        payload[VALUES] = np.clip(quantized, -127, 127).astype(np.int8)
        payload[SCALES] = scales
    else:
        k = top_count(values.size, codec.fraction)
        indices = np.sort(np.argpartition(np.abs(values), values.size - k)[values.size - k :]) if k else []
        payload[INDICES] = np.asarray(indices, np.int32)
        payload[VALUES] = values[indices]
    return payload


def _field(
    payload: Mapping[str, np.ndarray], name: str, dtype: type, size: int, *, at_most: bool = False
) -> np.ndarray:
    """``payload[name]``, checked to be a vector of ``dtype`` with ``size`` values (or at most that many)."""
    array = payload[name]
    if array.dtype != np.dtype(dtype):
        raise CodecError(f"{name} is {array.dtype}, expected {np.dtype(dtype)}")
    if array.ndim != 1 or array.size > size or (array.size != size and not at_most):
        raise CodecError(f"{name} has shape {array.shape}, expected ({'at most ' if at_most else ''}{size},)")
    return array


def _expect_names(payload: Mapping[str, np.ndarray], names: Iterable[str]) -> None:
    expected = set(names)
    if missing := sorted(expected - set(payload)):
        raise CodecError(f"missing {missing[0][:64]!r}")
    if extra := sorted(set(payload) - expected):
        raise CodecError(f"unexpected {extra[0][:64]!r}")


def _decode(payload: Mapping[str, np.ndarray], codec: Codec, shapes: Shapes) -> NamedArrays:
    if codec.kind == "fp32":
        _expect_names(payload, (name for name, _ in shapes))
        for name, shape in shapes:
            if (got := payload[name]).dtype != np.float32 or got.shape != shape:
                raise CodecError(f"{name[:64]} is {got.dtype} {got.shape}, expected float32 {shape}")
        return {name: payload[name] for name, _ in shapes}
    dense, coded = _split(shapes)
    n = _size(coded)
    if codec.kind == "fp16":
        _expect_names(payload, (DENSE, VALUES))
        values = _field(payload, VALUES, np.float16, n).astype(np.float32)
    elif codec.kind == "int8":
        _expect_names(payload, (DENSE, VALUES, SCALES))
        lengths = _row_lengths(coded, codec.per_channel)
        scales = _field(payload, SCALES, np.float32, lengths.size)
        if not (np.isfinite(scales) & (scales >= 0)).all():
            raise CodecError("int8 scales must be finite and >= 0")
        values = _field(payload, VALUES, np.int8, n) * np.repeat(scales, lengths)
    else:
        _expect_names(payload, (DENSE, INDICES, VALUES))
        indices = _field(payload, INDICES, np.int32, top_count(n, codec.fraction), at_most=True).astype(np.int64)
        sent = _field(payload, VALUES, np.float32, indices.size)
        if indices.size and not (indices.min() >= 0 and indices.max() < n):
            raise CodecError(f"top-k indices must be in [0, {n})")
        if not (np.diff(indices) > 0).all():  # int64: no wrap-around between int32 extremes
            raise CodecError("top-k indices must be strictly increasing (no duplicates)")
        values = np.zeros(n, np.float32)
        values[indices] = sent
    parts = {**_cut(_field(payload, DENSE, np.float32, _size(dense)), dense), **_cut(values, coded)}
    return {name: parts[name] for name, _ in shapes}


def decode(payload: Mapping[str, np.ndarray], codec: Codec, spec: Sequence[TensorShape]) -> NamedArrays:
    """Float32 arrays with exactly ``spec``'s names and shapes, in its order; ``CodecError`` if ``payload``
    (untrusted) is not a ``codec`` encoding of such a change."""
    return _decode(payload, codec, tuple((s.name, tuple(s.shape)) for s in spec))


@dataclass(frozen=True)
class Compressed:
    payload: NamedArrays  # what the update carries (``UpdateMeta.codec = str(codec)``)
    sent: NamedArrays  # float32, what the server decodes: the agent's model after the round is start + sent


@dataclass(frozen=True)
class ErrorFeedback:
    """The part of an agent's past changes its codec has not sent yet, kept in ``path`` (mode 0600,
    replaced atomically) so it survives a restart. It belongs to one server run (``run_id``, from the
    round task), one codec and one set of tensor names and shapes; under anything else it starts at zero."""

    path: Path
    run_id: str

    def scope(self, codec: Codec, shapes: Shapes) -> str:
        return hashlib.sha256(json.dumps([self.run_id, str(codec), sorted(shapes)]).encode()).hexdigest()

    def residual(self, scope: str, shapes: Shapes) -> NamedArrays:
        """The kept residual, or zeros if there is none for ``scope`` (none yet, another run or model, or
        an unreadable file: losing a residual only delays what it held)."""
        try:
            with safe_open(self.path, framework="np") as handle:
                if (handle.metadata() or {}) == {"format": RESIDUAL_FORMAT, "scope": scope}:
                    return {name: handle.get_tensor(name) for name, _ in shapes}
        except (FileNotFoundError, SafetensorError):
            pass
        return {name: np.zeros(shape, np.float32) for name, shape in shapes}

    def keep(self, scope: str, residual: NamedArrays) -> None:
        """Store ``residual``; a non-finite one (a diverged change) is dropped rather than carried forever."""
        if not all(np.isfinite(r).all() for r in residual.values()):
            residual = {name: np.zeros_like(r) for name, r in residual.items()}
        atomic_write(self.path, save(residual, metadata={"format": RESIDUAL_FORMAT, "scope": scope}), mode=0o600)


def compress(change: Mapping[str, np.ndarray], codec: Codec, feedback: ErrorFeedback | None = None) -> Compressed:
    """Encode ``change``; with ``feedback`` and a codec that uses it, what earlier rounds did not send is
    added first and what this payload does not send is kept: ``corrected = change + residual``,
    ``residual = corrected - sent``, so the server receives every change eventually."""
    shapes = tuple((name, tuple(a.shape)) for name, a in change.items())
    if feedback is None or not codec.feedback:
        payload = encode(change, codec)
        return Compressed(payload, _decode(payload, codec, shapes))
    scope = feedback.scope(codec, shapes)
    residual = feedback.residual(scope, shapes)
    corrected = {name: np.add(change[name], residual[name], dtype=np.float32) for name, _ in shapes}
    payload = encode(corrected, codec)
    sent = _decode(payload, codec, shapes)
    feedback.keep(scope, {name: corrected[name] - sent[name] for name, _ in shapes})
    return Compressed(payload, sent)
