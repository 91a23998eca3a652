"""Durable files for every package: atomic replace, so a ``kill -9`` leaves the old file or the new one.

Write to a fresh temporary file (``O_EXCL``, random name, the final mode from the first byte, so a
private key is never readable by others even for an instant), fsync it, ``os.replace`` it over the
target, then fsync the directory. This is the only place SkyFed writes state; never write in place.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

Buffer = bytes | bytearray | memoryview


def atomic_write(path: Path, data: Buffer | tuple[Buffer, ...], mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (or its parts, one after another: a header and a large array written
    where it lies, without joining them into one copy) atomically and durably; the file gets ``mode``
    (umask aside). Plain descriptor calls, the folder made only when the first open finds none: each system
    call lets other threads take the interpreter, and a process hosting 100 agents waited its turn back after
    every one of them (``sim.agent_host``)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(tmp, flags, mode)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, mode)
    try:
        try:
            for part in data if isinstance(data, tuple) else (data,):
                view = memoryview(part)
                if not view.nbytes:  # nothing to write (and an empty (0, 4) array has no byte cast)
                    continue
                view = view.cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def json_text(value: Any) -> str:
    """Compact, sorted keys, so the C encoder runs: the checkpoint is rewritten after every accepted update, and an
    indented dump (pure-Python encoder) took most of a 1,000-agent round (``jq`` reads it for people)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def write_json(path: Path, value: Any, mode: int = 0o644) -> None:
    atomic_write(path, json_text(value).encode(), mode)


def read_json(path: Path) -> Any:
    """Our own state files (trusted: we wrote them atomically)."""
    return json.loads(path.read_text())
