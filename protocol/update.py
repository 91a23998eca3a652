"""What travels inside a sealed update besides the tensors: the ``UpdateMeta`` header.

An update's plaintext is a safetensors buffer (never pickle) of float32 deltas over the global model's
floating tensors, or their encoding by ``codec`` (``protocol.codecs``: the round task names it, the server
decodes before any check); its ``__metadata__`` (string to string, as safetensors requires) carries this
header. ``weight`` is what strategies weigh the update by: its training samples for classifiers, its
annotated objects for detectors (seed 001's FedAvg weighting); ``samples`` stays the image count.
``local_eval`` is the agent's own validation of its trained model (e.g. ``map50``), and ``start_eval`` its
evaluation of the model it started from on its local test split (C-SPE): reported, never trusted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from common.untrusted_json import parse_untrusted_json
from protocol.codecs import Codec, CodecError

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
    local_epsilon: float | None = None  # the agent's own DP-SGD epsilon so far (agent.local_dp), if it uses it
    local_delta: float | None = None
    weight: int = 0  # 0: the same as ``samples``
    local_eval: dict[str, float] = field(default_factory=dict)
    start_eval: dict[str, float] = field(default_factory=dict)  # the start model on the agent's local test split

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
            )
        except (KeyError, ValueError, TypeError) as exc:
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
