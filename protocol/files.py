"""Durable state files for both daemons: atomic replace, so a ``kill -9`` leaves the old or the new file.

Write to a temporary file in the same directory, fsync it, ``os.replace`` it over the target, then
fsync the directory. Never a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json(path: Path, value: Any) -> None:
    atomic_write(path, json.dumps(value, indent=1, sort_keys=True).encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
