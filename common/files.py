"""Durable files for every package: atomic replace, so a ``kill -9`` leaves the old file or the new one.

Write to a fresh temporary file (``O_EXCL``, random name, the final mode from the first byte, so a
private key is never readable by others even for an instant), fsync it, ``os.replace`` it over the
target, then fsync the directory. This is the only place SkyFed writes state; never write in place.

Stores that write many large files a round (the server's updates and kept models) may hand ``AtomicFile`` a
file they no longer need (``reuse``, from ``common.spare_files``): it is renamed to the temporary name and
written over, so the file system allocates no new blocks. That is the one write in place, into a file no name
but the temporary one reaches (a spare with another link is not reused), so the target still gets the old bytes
or the new ones, and its mode is the spare's narrowed to ``mode``.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

Buffer = bytes | bytearray | memoryview
SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


class AtomicFile:
    """A file written a piece at a time (``write``) that replaces ``path`` only at ``commit``, durably; until
    then, and if the writer fails, ``path`` keeps its old bytes and the temporary file goes (``discard``).

    ``mode``: the new file's (umask aside). ``reuse``: a spare file of the same file system to write over
    instead of a new one (a new one when it is gone or has another link); its mode is narrowed to ``mode``.
    ``write_behind``: each piece starts on its way to disk as it is written (``start_writeback``). Plain
    descriptor calls, the folder made only when the first open finds none: each system call lets other threads
    take the interpreter, and a process hosting 100 agents waited its turn back after every one of them
    (``sim.agent_host``)."""

    def __init__(self, path: Path, mode: int = 0o644, reuse: Path | None = None, write_behind: bool = False) -> None:
        self.path, self.reused, self.size, self.write_behind = path, reuse is not None, 0, write_behind
        self._tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            self._fd = self._open(mode, reuse)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = self._open(mode, reuse)

    def _open(self, mode: int, reuse: Path | None) -> int:
        if reuse is not None:
            try:
                os.replace(reuse, self._tmp)
            except FileNotFoundError:
                if not self._tmp.parent.is_dir():
                    raise  # the folder is made and the open tried again
            else:
                fd = os.open(self._tmp, os.O_WRONLY | os.O_NOFOLLOW)
                try:
                    found = os.fstat(fd)
                    if stat.S_ISREG(found.st_mode) and found.st_nlink == 1:  # no other name sees what is written
                        os.fchmod(fd, found.st_mode & mode & 0o7777)  # never wider than the spare or ``mode``
                        return fd
                except BaseException:
                    os.close(fd)
                    raise
                os.close(fd)
                self._tmp.unlink()  # a hard link (a backup made with cp -al, say): a new file instead
        return os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

    def write(self, data: Buffer) -> None:
        """Append ``data``'s bytes (any buffer: an array is written where it lies)."""
        view = memoryview(data)
        if not view.nbytes:  # nothing to write (and an empty (0, 4) array has no byte cast)
            return
        view, start = view.cast("B"), self.size
        self.size += view.nbytes
        while view:
            view = view[os.write(self._fd, view) :]
        if self.write_behind:
            start_writeback(self._fd, start, self.size - start)

    def commit(self) -> None:
        """fsync, rename over ``path``, fsync the folder; discarded instead if any of it fails."""
        try:
            if self.reused:
                os.ftruncate(self._fd, self.size)  # a longer spare's tail goes
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self._tmp, self.path)
        except BaseException:
            self.discard()
            raise
        fsync_folder(self.path.parent)

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


def fsync_folder(folder: Path) -> None:
    """Make the renames in ``folder`` durable: a rename is a change to its folder, which a power loss may undo
    until the folder itself is fsynced."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing the file's bytes [offset, offset + length) to disk, without waiting
    (Linux's ``sync_file_range`` with ``SYNC_FILE_RANGE_WRITE``; elsewhere nothing): a file written piece by
    piece while other work goes on is then mostly on disk when its fsync comes, where the page cache would
    otherwise hold it all until then (the kernel starts on its own only past ``dirty_background_ratio``, 10 %
    of RAM). PostgreSQL's ``checkpoint_flush_after`` does the same for its checkpoints. A hint: errors are
    left to the fsync."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, length, SYNC_FILE_RANGE_WRITE)


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    import ctypes

    routine = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)  # glibc and musl on Linux
    if routine is not None:
        routine.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return routine


def atomic_write(
    path: Path, data: Buffer | tuple[Buffer, ...], mode: int = 0o644, reuse: Path | None = None
) -> None:
    """Replace ``path`` with ``data`` (or its parts, one after another: a header and a large array written
    where it lies, without joining them into one copy) atomically and durably (``AtomicFile``)."""
    file = AtomicFile(path, mode, reuse)
    try:
        for part in data if isinstance(data, tuple) else (data,):
            file.write(part)
    except BaseException:
        file.discard()
        raise
    file.commit()


def json_text(value: Any) -> str:
    """Compact, sorted keys, so the C encoder runs: the checkpoint is rewritten after every accepted update, and an
    indented dump (pure-Python encoder) took most of a 1,000-agent round (``jq`` reads it for people)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def write_json(path: Path, value: Any, mode: int = 0o644) -> None:
    atomic_write(path, json_text(value).encode(), mode)


def read_json(path: Path) -> Any:
    """Our own state files (trusted: we wrote them atomically)."""
    return json.loads(path.read_text())
