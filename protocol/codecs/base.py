"""What every update codec shares (``protocol.codecs``): the plug-in's interface and its declared
capabilities, the payload's field names, the running statistics sent dense, and the checks that refuse a
malformed payload. Pure numpy, like the whole package.

A lossy codec codes the change's tensors taken in name order as one flat vector; ``@dense`` carries the
BatchNorm running statistics, float32 and exact under every codec. They are averaged statistics, not
gradients, and few; rounded or dropped, a small running variance can come out negative, which the server
refuses (``validation.check_invariants``), and error feedback would carry stale statistics into later
rounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import ClassVar, Protocol

import numpy as np

NamedArrays = dict[str, np.ndarray]
Shapes = tuple[tuple[str, tuple[int, ...]], ...]

RUNNING_STATISTICS = ("running_mean", "running_var")  # = models.weights.RUNNING_STATISTICS (a test pins it)
DENSE, VALUES, SCALES, INDICES = "@dense", "@values", "@scales", "@indices"


class CodecError(ValueError):
    """A codec name that is not one, or a payload that does not decode to the model; says why, briefly."""


class TensorShape(Protocol):  # models.weights.TensorSpec is one
    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


class CodecPlugin:
    """One codec with its argument, a frozen dataclass in its own module. It declares what it is (class
    attributes, asked through the registry's ``where``) and codes the flat vector of a change's non-dense
    values: ``encode_values`` gives the payload's fields besides ``@dense``, ``decode_values`` checks them
    (untrusted) and gives the vector back. ``fp32`` alone overrides ``encode``/``decode`` (named tensors)."""

    name: ClassVar[str]
    spellings: ClassVar[tuple[str, ...]]  # how server.codec may name it, for the choices: "int8", "int8:channel"
    hint: ClassVar[str] = ""  # what its argument may be, if it takes one: "0 < FRACTION <= 1, e.g. topk:0.01"
    lossy: ClassVar[bool] = True  # decode(encode(x)) may differ from x
    error_feedback: ClassVar[bool] = False  # compress carries what it did not send into the next round
    fields: ClassVar[tuple[str, ...]] = ()  # the payload's arrays besides @dense

    @classmethod
    def parse(cls, arg: str | None) -> CodecPlugin:
        """The codec for the text after ``name:`` (``None``: no colon); ``ValueError`` if it is not one."""
        if arg is not None:
            raise ValueError(f"{cls.name} takes no argument")
        return cls()

    def __str__(self) -> str:
        return self.name

    def encode_values(self, values: np.ndarray, coded: Shapes) -> NamedArrays:
        raise NotImplementedError

    def decode_values(self, payload: Mapping[str, np.ndarray], coded: Shapes) -> np.ndarray:
        raise NotImplementedError

    def encode(self, change: Mapping[str, np.ndarray]) -> NamedArrays:
        dense, coded = split((name, a.shape) for name, a in change.items())
        return {DENSE: flat(change, dense), **self.encode_values(flat(change, coded), coded)}

    def decode(self, payload: Mapping[str, np.ndarray], shapes: Shapes) -> NamedArrays:
        dense, coded = split(shapes)
        expect_names(payload, (DENSE, *self.fields))
        values = self.decode_values(payload, coded)
        parts = {**cut(field(payload, DENSE, np.float32, size(dense)), dense), **cut(values, coded)}
        return {name: parts[name] for name, _ in shapes}


class ChosenCodec(Protocol):  # protocol.codecs.Codec is one
    """What ``feedback.compress`` asks of ``server.codec``'s value: its plug-in, whether it carries the unsent
    remainder, and its text (``str``), which scopes a kept residual."""

    @property
    def plugin(self) -> CodecPlugin: ...

    @property
    def feedback(self) -> bool: ...


def split(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> tuple[Shapes, Shapes]:
    """(dense, coded): the running statistics and the other tensors, each in name order."""
    ordered = sorted(shapes)
    dense = tuple(s for s in ordered if s[0].endswith(RUNNING_STATISTICS))
    return dense, tuple(s for s in ordered if not s[0].endswith(RUNNING_STATISTICS))


def flat(arrays: Mapping[str, np.ndarray], shapes: Shapes) -> np.ndarray:
    parts = [np.asarray(arrays[name], np.float32).reshape(-1) for name, _ in shapes]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def cut(vector: np.ndarray, shapes: Shapes) -> NamedArrays:
    out, offset = {}, 0
    for name, shape in shapes:
        count = math.prod(shape)
        out[name] = vector[offset : offset + count].reshape(shape)
        offset += count
    return out


def size(shapes: Shapes) -> int:
    return sum(math.prod(shape) for _, shape in shapes)


def starts(lengths: np.ndarray) -> np.ndarray:
    """Where each run of ``lengths`` values begins in the flat vector (for ``np.ufunc.reduceat``)."""
    return np.cumsum(lengths) - lengths


def field(
    payload: Mapping[str, np.ndarray], name: str, dtype: type, count: int, *, at_most: bool = False
) -> np.ndarray:
    """``payload[name]``, checked to be a vector of ``dtype`` with ``count`` values (or at most that many)."""
    array = payload[name]
    if array.dtype != np.dtype(dtype):
        raise CodecError(f"{name} is {array.dtype}, expected {np.dtype(dtype)}")
    if array.ndim != 1 or array.size > count or (array.size != count and not at_most):
        raise CodecError(f"{name} has shape {array.shape}, expected ({'at most ' if at_most else ''}{count},)")
    return array


def scales(payload: Mapping[str, np.ndarray], name: str, count: int, what: str) -> np.ndarray:
    """``count`` float32 scales, each finite and >= 0 (a forged NaN, infinity or negative one is refused)."""
    values = field(payload, name, np.float32, count)
    if not (np.isfinite(values) & (values >= 0)).all():
        raise CodecError(f"{what} must be finite and >= 0")
    return values


def expect_names(payload: Mapping[str, np.ndarray], names: Iterable[str]) -> None:
    expected = set(names)
    if missing := sorted(expected - set(payload)):
        raise CodecError(f"missing {missing[0][:64]!r}")
    if extra := sorted(set(payload) - expected):
        raise CodecError(f"unexpected {extra[0][:64]!r}")
