"""What travels inside a sealed update besides the tensors: the ``UpdateMeta`` header.

An update's plaintext is a safetensors buffer (never pickle) of float32 deltas over the global model's
floating tensors, or their encoding by ``codec`` (``protocol.codecs``: the round task names it, the server
decodes before any check); its ``__metadata__`` (string to string, as safetensors requires) carries this
header. ``weight`` is what strategies weigh the update by: its training samples for classifiers, its
annotated objects for detectors (seed 001's FedAvg weighting); ``samples`` stays the image count.
``local_eval`` is the agent's own validation of its trained model (e.g. ``map50``), ``start_eval`` its
evaluation of the model it started from on its local test split (C-SPE), and ``trained_eval`` that of the model it
is judged by after training (the seeds' C-SPE): reported, never trusted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from common.untrusted_json import parse_untrusted_json
from models.serialization import SerializationError, dumps, float32_region, loads, read_header
from models.weights import NamedArrays, TensorSpec, delta, fingerprint, flatten, float_part, unflatten
from protocol.codecs import FP32, Codec, CodecError, ErrorFeedback, compress, decode
from protocol.messages import RoundTask

FORMAT = "skyfed.update/1"
MAX_SAMPLES = 2**53  # exact as a float; larger claims are refused, smaller ones capped by the server's bounds


class UpdateMetaError(ValueError):
    """The update header is missing, of another format, or has a bad value."""


@dataclass(frozen=True)
class UpdateMeta:
    round: int
    base_version: int
    samples: int
    loss: float
    codec: str = "fp32"  # protocol.codecs.Codec's name; agents from before codecs said "none" (the same)
    base_sha256: str = ""  # fingerprint of the start model when it was not the global one
    local_epsilon: float | None = None  # the agent's own DP-SGD epsilon so far (participant.local_dp), if it uses it
    local_delta: float | None = None
    weight: int = 0  # 0: the same as ``samples``
    local_eval: dict[str, float] = field(default_factory=dict)
    start_eval: dict[str, float] = field(default_factory=dict)  # the start model on the agent's local test split
    trained_eval: dict[str, float] = field(default_factory=dict)  # the trained model on that split

    def __post_init__(self) -> None:
        if self.weight == 0:
            object.__setattr__(self, "weight", self.samples)

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "round": str(self.round),
            "base_version": str(self.base_version),
            "samples": str(self.samples),
            "loss": repr(float(self.loss)),
            "codec": self.codec,
            "base_sha256": self.base_sha256,
            **({} if self.local_epsilon is None else {"local_epsilon": repr(self.local_epsilon)}),
            **({} if self.local_delta is None else {"local_delta": repr(self.local_delta)}),
            "weight": str(self.weight),
            **({"local_eval": json.dumps(local_eval)} if (local_eval := _finite(self.local_eval)) else {}),
            **({"start_eval": json.dumps(start_eval)} if (start_eval := _finite(self.start_eval)) else {}),
            **({"trained_eval": json.dumps(trained)} if (trained := _finite(self.trained_eval)) else {}),
        }

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> UpdateMeta:
        if metadata.get("format") != FORMAT:
            raise UpdateMetaError(f"bad-format: expected {FORMAT}, got {metadata.get('format')!r}")
        try:
            meta = cls(
                round=int(metadata["round"]),
                base_version=int(metadata["base_version"]),
                samples=int(metadata["samples"]),
                loss=float(metadata["loss"]),
                codec=metadata.get("codec", "fp32"),
                base_sha256=metadata.get("base_sha256", ""),
                local_epsilon=_optional_float(metadata.get("local_epsilon")),
                local_delta=_optional_float(metadata.get("local_delta")),
                weight=int(metadata.get("weight", "0")),
                local_eval=_local_eval(metadata.get("local_eval")),
                start_eval=_local_eval(metadata.get("start_eval"), "start_eval"),
                trained_eval=_local_eval(metadata.get("trained_eval"), "trained_eval"),
            )
        except (KeyError, ValueError, TypeError, OverflowError) as exc:  # Overflow: a score of 400 digits
            raise UpdateMetaError(f"bad-metadata: {exc}") from None
        if not 0 < meta.samples <= MAX_SAMPLES:
            raise UpdateMetaError(f"bad-samples: {str(meta.samples)[:24]}")
        if not 0 < meta.weight <= MAX_SAMPLES:
            raise UpdateMetaError(f"bad-weight: {str(meta.weight)[:24]}")
        if not math.isfinite(meta.loss):
            raise UpdateMetaError("non-finite-loss")
        for value in (meta.local_epsilon, meta.local_delta):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise UpdateMetaError("bad-metadata: local privacy values must be finite and >= 0")
        return replace(meta, codec=_codec(meta.codec))


def _finite(values: dict[str, float]) -> dict[str, float]:
    """An evaluation without its non-finite numbers (a start model whose loss is NaN still says its accuracy):
    the server refuses a header carrying one, and with it the whole update."""
    return {name: value for name, value in values.items() if math.isfinite(value)}


def _codec(text: str) -> str:
    """The codec's canonical name (``topk:1e-2`` is ``topk:0.01``), so the server compares names."""
    try:
        return str(Codec.parse("fp32" if text == "none" else text))
    except CodecError:
        raise UpdateMetaError(f"unsupported-codec: {text[:40]}") from None


def _optional_float(text: str | None) -> float | None:
    return None if text is None or text == "" else float(text)


MAX_LOCAL_EVAL = 16
MAX_LOCAL_EVAL_BYTES = 4096  # 16 short names and numbers need a fraction of this


def _local_eval(text: str | None, key: str = "local_eval") -> dict[str, float]:
    """At most ``MAX_LOCAL_EVAL`` finite numbers by short name; anything else is a bad header (``key`` names it)."""
    if not text:
        return {}
    values = parse_untrusted_json(text, max_bytes=MAX_LOCAL_EVAL_BYTES)  # UntrustedJsonError is a ValueError
    if not isinstance(values, dict) or len(values) > MAX_LOCAL_EVAL:
        raise ValueError(f"{key} must be an object of at most {MAX_LOCAL_EVAL} numbers")
    out = {}
    for name, value in values.items():
        if len(name) > 32 or isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{key} values must be finite numbers under names of at most 32 characters")
        out[name] = float(value)
    return out


@dataclass(frozen=True)
class TrainResult:
    arrays: NamedArrays
    samples: int
    loss: float
    epsilon: float | None = None  # this agent's own DP-SGD epsilon after the round (local DP only)
    weight: int = 0  # what the server weighs the update by (0: ``samples``); detectors: annotated objects
    local_eval: dict[str, float] = field(default_factory=dict)  # the trainer's own validation, e.g. map50
    start_eval: dict[str, float] = field(default_factory=dict)  # the start model on the local test split (C-SPE)
    trained_eval: dict[str, float] = field(default_factory=dict)  # the judged model after training, on that split


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


def float_layout(arrays: NamedArrays) -> tuple[tuple[TensorSpec, ...], np.ndarray]:
    """How an update over the model ``arrays`` lays out its float32 tensors (``spec``, the ``expected_spec`` of
    ``parse_update``) and the model's floats as one vector in that layout."""
    floats = {k: v.astype(np.float32) for k, v in float_part(arrays).items()}
    _, spec, _ = float32_region(dumps(floats))
    return spec, flatten(floats, spec)


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


def encode_update(
    task: RoundTask,
    base: NamedArrays,
    result: TrainResult,
    *,
    residual: Path,
    base_sha256: str = "",
    local_delta: float | None = None,
) -> tuple[bytes, NamedArrays]:
    """The update's plaintext: the change from the start model ``base`` (``base_sha256`` when that was not the
    global one) in the round's codec (``protocol.codecs``; top-k keeps what it did not send in ``residual``,
    for later rounds), with the metadata the server checks it by; and the float32 change the server will
    decode from it (the agent's own model after the round is ``base`` plus that, bit for bit)."""
    codec = Codec.parse(task.codec)
    out = compress(delta(result.arrays, base), codec, ErrorFeedback(residual, task.run_id))
    epsilon = result.epsilon if result.epsilon is not None and math.isfinite(result.epsilon) else None
    meta = UpdateMeta(round=task.round, base_version=task.model_version, samples=result.samples, loss=result.loss,
                      base_sha256=base_sha256, local_epsilon=epsilon, local_delta=local_delta, weight=result.weight,
                      local_eval=result.local_eval, start_eval=result.start_eval, trained_eval=result.trained_eval,
                      codec=str(codec))  # fmt: skip
    return dumps(out.payload, metadata=meta.to_metadata()), out.sent


def encode_model(task: RoundTask, start: NamedArrays, result: TrainResult, *, residual: Path,
                 local_delta: float | None = None) -> bytes:  # fmt: skip
    """A peer's trained model in the update format (its change over zero), naming the model ``start`` it trained
    from by fingerprint: each receiver takes the change from its own model (``agent.peer.collect``)."""
    zero = {name: np.zeros_like(array) for name, array in float_part(start).items()}
    data, _ = encode_update(task, zero, result, residual=residual, base_sha256=fingerprint(start),
                            local_delta=local_delta)  # fmt: skip
    return data
