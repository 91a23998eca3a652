"""state_dict ⇄ named numpy arrays, and the delta arithmetic federated learning needs.

Only floating-point tensors are federated: parameters and float buffers such as BatchNorm's running
statistics. Integer buffers (BatchNorm's ``num_batches_tracked``) are counts, not weights: averaging
them is meaningless, so deltas leave them out and the global model keeps its own values.
Pure functions: arrays in, arrays out. Torch-free at import (the agent daemon uses the arithmetic and
keeps PyTorch in its training child); only ``to_arrays`` and ``load_arrays`` touch tensors.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn

NamedArrays = dict[str, np.ndarray]


def to_arrays(source: nn.Module | Mapping[str, torch.Tensor]) -> NamedArrays:
    """A CPU, contiguous numpy copy of a model's state_dict, in state_dict order, dtypes kept."""
    state = source.state_dict() if hasattr(source, "state_dict") else source
    return {name: np.array(t.detach().cpu().numpy(), order="C", copy=True) for name, t in state.items()}


def load_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Load named arrays into ``model``; every name, shape and dtype must match its state_dict."""
    state = model.state_dict()
    if problem := spec_mismatch(arrays, state_spec(state)):
        raise ValueError(f"cannot load weights into {type(model).__name__}: {problem}")
    import torch

    model.load_state_dict({name: torch.from_numpy(np.array(arrays[name])) for name in state})


def is_float(array: np.ndarray) -> bool:
    return np.issubdtype(array.dtype, np.floating)


def float_part(arrays: Mapping[str, np.ndarray]) -> NamedArrays:
    """The floating entries only: what federated averaging combines."""
    return {name: a for name, a in arrays.items() if is_float(a)}


def delta(local: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> NamedArrays:
    """local − base over the floating entries of ``base``, as float32."""
    out = {}
    for name, b in float_part(base).items():
        if name not in local:
            raise ValueError(f"missing tensor {name!r} in the local model")
        if local[name].shape != b.shape:
            raise ValueError(f"shape of {name} is {local[name].shape}, expected {b.shape}")
        out[name] = np.subtract(local[name], b, dtype=np.float32)
    return out


def advanced(base: Mapping[str, np.ndarray], change: Mapping[str, np.ndarray]) -> NamedArrays:
    """``base`` + ``change`` on the floating entries (added in float32, stored in ``base``'s dtype); the
    integer entries stay ``base``'s. Agent and server both compute an agent's model after a round with
    this one function, so they hold the same bits and can name a model by its ``fingerprint``."""
    return {
        name: np.add(b, change[name], dtype=np.float32).astype(b.dtype, copy=False) if is_float(b) else b
        for name, b in base.items()
    }


class Digest(Protocol):
    """What ``Fingerprinter`` needs of a hashlib hash."""

    def update(self, data: bytes | np.ndarray, /) -> None: ...
    def hexdigest(self) -> str: ...


def fingerprint(arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 (hex) over every entry's name, dtype, shape and bytes, in name order: which model this is."""
    return Fingerprinter(arrays).hexdigest()


class Fingerprinter:
    """``fingerprint`` of a model whose floats (``spec``, in ``flatten`` order) arrive a piece at a time
    (``update``) and whose other entries are ``arrays``': a model the server computes is hashed as it is
    written, not read back. The streamed floats are float32 and come in name order, as safetensors stores them;
    each is hashed as the model holds it (``with_floats``): in its entry's dtype in ``arrays`` (a float16 model's
    floats travel as float32 and are held rounded), and a 0-d entry as ``fingerprint`` sees it, of shape (1,)."""

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        spec: tuple[TensorSpec, ...] = (),
        digest: Callable[[], Digest] = hashlib.sha256,
    ) -> None:
        """``digest``: SHA-256, or one whose ``hexdigest`` names the model without hashing it (``ModelBank.writer``)."""
        self._floats = {s.name: s for s in spec}
        names = sorted(set(arrays) | set(self._floats))
        if [n for n in names if n in self._floats] != [s.name for s in spec]:
            raise ValueError("a fingerprint's streamed tensors must come in name order")
        if any(np.dtype(s.dtype) != np.float32 for s in spec):
            raise ValueError("a fingerprint's streamed tensors must be float32")
        self._arrays, self._names = arrays, iter(names)
        self._digest = digest()
        self._left, self._held = 0, np.dtype(np.float32)  # the streamed entry under way: values to come, its dtype
        self._next_streamed()

    def _entry(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self._digest.update(f"{name}\0{dtype.str}\0{shape}\0".encode())

    def _next_streamed(self) -> None:
        """Hash the entries up to the next streamed one's name (all that are left, after the last)."""
        for name in self._names:
            if name in self._floats:
                held = self._arrays.get(name)
                self._held = np.dtype(np.float32) if held is None else held.dtype
                shape = tuple(self._floats[name].shape if held is None else held.shape) or (1,)
                self._entry(name, self._held, shape)
                self._left = math.prod(shape)
                if self._left:
                    return
            else:
                a = np.ascontiguousarray(self._arrays[name])
                self._entry(name, a.dtype, a.shape)
                self._digest.update(a)  # the array's own buffer: no copy, and hashlib lets other threads run

    def update(self, values: np.ndarray) -> list[np.ndarray]:
        """Hash the next float32 values of the streamed tensors; returns them as the model holds them, in float32
        pieces (rounded where an entry is narrower), which is what a file of its floats keeps."""
        if values.dtype != np.float32:
            raise ValueError(f"a fingerprint streams float32 values, not {values.dtype}")
        held = []
        while values.size:
            if not self._left:
                raise ValueError("more values than the fingerprint's tensors hold")
            piece = values[: self._left]
            as_held = np.ascontiguousarray(piece, dtype=self._held)  # float32: the piece itself
            self._digest.update(as_held)
            held.append(piece if self._held.itemsize >= 4 else as_held.astype(np.float32))
            self._left -= piece.size
            values = values[piece.size :]
            if not self._left:
                self._next_streamed()
        return held

    def hexdigest(self) -> str:
        if self._left:
            raise ValueError(f"{self._left} values of the fingerprint's tensors never came")
        return self._digest.hexdigest()


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorRange:
    """Where one tensor lives in the flat float vector of ``flatten``."""

    name: str
    start: int
    stop: int


RUNNING_STATISTICS = ("running_mean", "running_var")  # BatchNorm buffers: averaged statistics, not weights


def ranges_of(spec: tuple[TensorSpec, ...], suffixes: tuple[str, ...]) -> tuple[TensorRange, ...]:
    """The ranges of the tensors whose state_dict name ends with one of ``suffixes``."""
    ranges, offset = [], 0
    for s in spec:
        size = int(np.prod(s.shape, dtype=np.int64))
        if s.name.endswith(suffixes):
            ranges.append(TensorRange(s.name, offset, offset + size))
        offset += size
    return tuple(ranges)


def spec_of(arrays: Mapping[str, np.ndarray]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(name, a.dtype.str.lstrip("<>|="), tuple(a.shape)) for name, a in arrays.items())


def state_spec(source: nn.Module | Mapping[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    """``spec_of(to_arrays(source))`` without copying a tensor: checking a layout before a load stays cheap."""
    state = source.state_dict() if hasattr(source, "state_dict") else source
    return tuple(TensorSpec(name, _numpy_dtype(t.dtype), tuple(t.shape)) for name, t in state.items())


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> str:
    import torch

    return torch.empty(0, dtype=dtype).numpy().dtype.str.lstrip("<>|=")


def spec_mismatch(arrays: Mapping[str, np.ndarray], spec: tuple[TensorSpec, ...]) -> str | None:
    """A human reason why ``arrays`` do not fit ``spec`` (names, shapes, dtypes), or None."""
    for s in spec:
        if s.name not in arrays:
            return f"missing tensor {s.name!r}"
        a = arrays[s.name]
        if tuple(a.shape) != s.shape:
            return f"shape of {s.name} is {tuple(a.shape)}, expected {s.shape}"
        if a.dtype.str.lstrip("<>|=") != s.dtype:
            return f"dtype of {s.name} is {a.dtype}, expected {s.dtype}"
    extra = sorted(set(arrays) - {s.name for s in spec})
    return f"unexpected tensor {extra[0]!r}" if extra else None


def flatten(arrays: Mapping[str, np.ndarray], spec: tuple[TensorSpec, ...]) -> np.ndarray:
    """One float32 vector of the tensors in ``spec`` order."""
    if not spec:
        return np.zeros(0, np.float32)
    return np.concatenate([np.asarray(arrays[s.name], dtype=np.float32).reshape(-1) for s in spec])


def with_floats(arrays: Mapping[str, np.ndarray], vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> NamedArrays:
    """``arrays`` with their floating entries replaced by ``vector`` (``flatten`` layout, cast back to each
    entry's dtype); the other entries are kept."""
    floats = unflatten(vector, spec)
    return {name: floats[name].astype(a.dtype, copy=False) if name in floats else a for name, a in arrays.items()}


def unflatten(vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> NamedArrays:
    """Named float32 arrays cut from ``vector`` in ``spec`` order (views, no copy)."""
    out, offset = {}, 0
    for s in spec:
        size = int(np.prod(s.shape, dtype=np.int64))
        out[s.name] = vector[offset : offset + size].reshape(s.shape)
        offset += size
    if offset != vector.size:
        raise ValueError(f"vector has {vector.size} values, the spec needs {offset}")
    return out
