"""Safe serialization of named arrays: the safetensors format, never pickle.

Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes
of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}``, then the
raw little-endian data. Writing uses the ``safetensors`` package. Reading is done here, zero-copy:
arrays are views into the received buffer, so a 12.8 MB update is not copied on its way to the
aggregator, and every structural problem is refused with a reason before any array is built.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save

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
    """Serialize; safetensors stores tensors sorted by dtype alignment then name, back to back."""
    return save({k: np.asarray(v, order="C") for k, v in arrays.items()}, metadata=metadata)


def _parse_header(data: bytes | bytearray | memoryview, max_tensors: int) -> tuple[dict, dict[str, str], int]:
    if len(data) < 8:
        raise SerializationError(f"buffer of {len(data)} bytes is too short for a safetensors header")
    (header_len,) = struct.unpack_from("<Q", data, 0)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise SerializationError(f"header length {header_len} does not fit a buffer of {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SerializationError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SerializationError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SerializationError("__metadata__ must map strings to strings")
    if len(header) > max_tensors:
        raise SerializationError(f"{len(header)} tensors exceed the limit of {max_tensors}")
    return header, metadata, 8 + header_len


def _entries(header: dict, data_len: int) -> list[tuple[int, int, TensorSpec]]:
    entries = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise SerializationError(f"tensor {name!r} has a malformed entry") from None
        if dtype not in DTYPES:
            raise SerializationError(f"tensor {name!r} has unsupported dtype {dtype!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not (
            isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_len
        ):
            raise SerializationError(f"tensor {name!r} has bad shape or offsets")
        if int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize != end - begin:
            raise SerializationError(f"tensor {name!r}: shape {shape} does not match {end - begin} bytes")
        entries.append((begin, end, TensorSpec(name, np.dtype(DTYPES[dtype]).str.lstrip("<>|="), shape)))
    entries.sort(key=lambda e: (e[0], e[1]))
    position = 0
    for begin, end, spec in entries:
        if begin != position:
            raise SerializationError(f"tensor {spec.name!r} overlaps or leaves a gap at byte {position}")
        position = end
    if position != data_len:
        raise SerializationError(f"data section has {data_len - position} bytes no tensor accounts for")
    return entries


def loads(data: bytes | bytearray | memoryview, *, max_tensors: int = 10_000) -> tuple[NamedArrays, dict[str, str]]:
    """Named arrays as zero-copy views into ``data``, and the metadata; ``SerializationError`` if malformed."""
    header, metadata, start = _parse_header(data, max_tensors)
    arrays = {}
    for begin, end, spec in _entries(header, len(data) - start):
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        arrays[spec.name] = np.frombuffer(data, dtype, count=(end - begin) // dtype.itemsize, offset=start + begin)
        arrays[spec.name] = arrays[spec.name].reshape(spec.shape)
    return arrays, metadata


def float32_region(data: bytes | bytearray | memoryview) -> tuple[np.ndarray, tuple[TensorSpec, ...], dict[str, str]]:
    """For an all-float32 buffer (a delta): one flat zero-copy vector, the specs in data order, metadata.

    The aggregator folds this vector with a single BLAS call; ``models.weights.unflatten`` with the
    returned specs gives the named tensors back.
    """
    header, metadata, start = _parse_header(data, 10_000)
    entries = _entries(header, len(data) - start)
    specs = tuple(spec for _, _, spec in entries)
    for spec in specs:
        if spec.dtype != "f4":
            raise SerializationError(f"tensor {spec.name!r} is {spec.dtype}, an update must be float32")
    vector = np.frombuffer(data, np.dtype("<f4"), count=(len(data) - start) // 4, offset=start)
    return vector, specs, metadata


def save_file(path: Path, arrays: NamedArrays, metadata: dict[str, str] | None = None) -> None:
    """Write atomically (temporary file, fsync, rename): a crash leaves the old file or the new one."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(dumps(arrays, metadata))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_file(path: Path) -> tuple[NamedArrays, dict[str, str]]:
    """Read a file written by ``save_file``; the arrays are private copies."""
    arrays, metadata = loads(path.read_bytes())
    return {name: a.copy() for name, a in arrays.items()}, metadata
