"""Safe serialization of named arrays: the safetensors format, never pickle.

Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes
of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}``, then the
raw little-endian data. Writing uses the ``safetensors`` package, its header re-encoded with sorted keys
(``dumps``). Reading is done here, zero-copy: arrays are views into the received buffer, so a 12.8 MB
update is not copied on its way to the aggregator, and every structural problem is refused with a
reason before any array is built.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from common.files import atomic_write
from common.untrusted_json import UntrustedJsonError, parse_untrusted_json
from models.weights import NamedArrays, TensorSpec

MAX_HEADER_BYTES = 16 << 20
DTYPES = {
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SerializationError(ValueError):
    """Bytes that are not a well-formed safetensors buffer; the message says what is wrong."""


def dumps(arrays: NamedArrays, metadata: dict[str, str] | None = None) -> bytes:
    """Serialize; the bytes are a pure function of the content, so a model published again (a healed
    retained chunk, an inbox resend, a key rotation) has the SHA-256 its signed task names.

    safetensors stores tensors sorted by dtype alignment then name, back to back, but writes the metadata
    from a hash map whose order changes between calls; its header is re-encoded here with sorted keys,
    padded with spaces to 8 bytes as safetensors pads it, and the data after it is left as written.
    """
    raw = memoryview(save({k: np.asarray(v, order="C") for k, v in arrays.items()}, metadata=metadata))
    (length,) = struct.unpack_from("<Q", raw, 0)
    header = json.dumps(json.loads(bytes(raw[8 : 8 + length])), sort_keys=True, separators=(",", ":"),
                        ensure_ascii=False).encode()  # fmt: skip
    header += b" " * (-len(header) % 8)
    return b"".join((struct.pack("<Q", len(header)), header, raw[8 + length :]))


def float32_header(spec: tuple[TensorSpec, ...]) -> bytes:
    """The header ``dumps`` writes for ``spec``'s tensors, whose float32 values follow it in ``flatten`` order
    (a file written as its values are computed). ``spec`` is all float32 in the order safetensors stores it, by
    name (``float32_region``'s and the server's layout)."""
    names = [s.name for s in spec]
    if any(np.dtype(s.dtype) != np.float32 for s in spec) or names != sorted(names):
        raise ValueError("a kept model's file holds float32 tensors in safetensors' order (by name)")
    entries, offset = {}, 0
    for s in spec:
        size = 4 * math.prod(s.shape)
        entries[s.name] = {"data_offsets": [offset, offset + size], "dtype": "F32", "shape": list(s.shape)}
        offset += size
    header = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def _parse_header(data: bytes | bytearray | memoryview, max_tensors: int) -> tuple[dict, dict[str, str], int]:
    if len(data) < 8:
        raise SerializationError(f"buffer of {len(data)} bytes is too short for a safetensors header")
    (header_len,) = struct.unpack_from("<Q", data, 0)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise SerializationError(f"header length {header_len} does not fit a buffer of {len(data)} bytes")
    try:
        header = parse_untrusted_json(data[8 : 8 + header_len], max_bytes=MAX_HEADER_BYTES)
    except UntrustedJsonError as exc:
        raise SerializationError(f"header: {exc}") from None
    if not isinstance(header, dict):
        raise SerializationError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SerializationError("__metadata__ must map strings to strings")
    if len(header) > max_tensors:
        raise SerializationError(f"{len(header)} tensors exceed the limit of {max_tensors}")
    return header, metadata, 8 + header_len


def _entry(name: str, info: object, data_len: int) -> tuple[int, int, TensorSpec]:
    """One header entry, checked: known dtype, non-negative int shape, offsets inside the data."""
    if not isinstance(info, dict):
        raise SerializationError(f"tensor {name[:64]!r} has a malformed entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SerializationError(f"tensor {name[:64]!r} has unsupported dtype {str(dtype)[:16]!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SerializationError(f"tensor {name[:64]!r} has a bad shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise SerializationError(f"tensor {name[:64]!r} has bad offsets")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise SerializationError(f"tensor {name[:64]!r} has offsets outside the data")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    if math.prod(shape) * itemsize != end - begin:  # Python ints: no overflow on hostile shapes
        raise SerializationError(f"tensor {name[:64]!r}: shape {tuple(shape)} does not match {end - begin} bytes")
    return begin, end, TensorSpec(name, np.dtype(DTYPES[dtype]).str.lstrip("<>|="), tuple(shape))


def _entries(header: dict, data_len: int) -> list[tuple[int, int, TensorSpec]]:
    entries = sorted((_entry(name, info, data_len) for name, info in header.items()), key=lambda e: (e[0], e[1]))
    position = 0
    for begin, end, spec in entries:
        if begin != position:
            raise SerializationError(f"tensor {spec.name[:64]!r} overlaps or leaves a gap at byte {position}")
        position = end
    if position != data_len:
        raise SerializationError(f"data section has {data_len - position} bytes no tensor accounts for")
    return entries


@dataclass(frozen=True)
class Header:
    """A checked safetensors header: the tensors in data order, the metadata, where the data starts."""

    entries: tuple[tuple[int, int, TensorSpec], ...]
    metadata: dict[str, str]
    start: int


def read_header(data: bytes | bytearray | memoryview, *, max_tensors: int = 10_000) -> Header:
    """The header alone, fully checked, so a reader can look at the metadata before choosing how to read
    the tensors (``loads`` or ``float32_region``) without parsing the header twice."""
    header, metadata, start = _parse_header(data, max_tensors)
    return Header(tuple(_entries(header, len(data) - start)), metadata, start)


def loads(
    data: bytes | bytearray | memoryview, *, max_tensors: int = 10_000, header: Header | None = None
) -> tuple[NamedArrays, dict[str, str]]:
    """Named arrays as zero-copy views into ``data``, and the metadata; ``SerializationError`` if malformed."""
    header = header or read_header(data, max_tensors=max_tensors)
    arrays, start = {}, header.start
    for begin, end, spec in header.entries:
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        arrays[spec.name] = np.frombuffer(data, dtype, count=(end - begin) // dtype.itemsize, offset=start + begin)
        arrays[spec.name] = arrays[spec.name].reshape(spec.shape)
    return arrays, header.metadata


def float32_region(
    data: bytes | bytearray | memoryview, header: Header | None = None
) -> tuple[np.ndarray, tuple[TensorSpec, ...], dict[str, str]]:
    """For an all-float32 buffer (a delta): one flat zero-copy vector, the specs in data order, metadata.

    The aggregator folds this vector with a single BLAS call; ``models.weights.unflatten`` with the
    returned specs gives the named tensors back.
    """
    header = header or read_header(data)
    specs = tuple(spec for _, _, spec in header.entries)
    for spec in specs:
        if spec.dtype != "f4":
            raise SerializationError(f"tensor {spec.name!r} is {spec.dtype}, an update must be float32")
    vector = np.frombuffer(data, np.dtype("<f4"), count=(len(data) - header.start) // 4, offset=header.start)
    return vector, specs, header.metadata


def save_file(path: Path, arrays: NamedArrays, metadata: dict[str, str] | None = None) -> None:
    """Write atomically (``common.files``): a crash leaves the old file or the new one."""
    atomic_write(path, dumps(arrays, metadata))


def load_file(path: Path) -> tuple[NamedArrays, dict[str, str]]:
    """Read a file written by ``save_file``; the arrays are private copies."""
    arrays, metadata = loads(path.read_bytes())
    return {name: a.copy() for name, a in arrays.items()}, metadata
