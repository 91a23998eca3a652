"""One daemon per state directory: an exclusive ``flock`` on ``<state_dir>/skyfed.lock``, held for life (or,
for a daemon on a thread of ``skyfed.api``, until it stops).

Two servers (or two agents) on one folder overwrite each other's checkpoint and evict each other from
the broker (one MQTT client id); worse, the one that stops last leaves a state that went back in time.
The lock is the kernel's: it is released when the process ends, however it ends (``kill -9``, power
loss), so it never goes stale and nobody has to delete it. The file also holds the holder's PID, for
the message a second daemon prints; it is written in place (replacing the file would lock another
inode), and it is only informational. The descriptor is not inherited by children (Python's default),
so a training child that outlives its daemon does not keep the folder locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "skyfed.lock"
_held: dict[Path, int] = {}  # directory -> open descriptor, kept for the life of the process


class StateDirInUse(ValueError):
    """Another live process holds the folder; the message names it, the holder and the fix."""


def hold_state_dir(directory: Path, key: str, *, again_ok: bool = True) -> None:
    """Lock ``directory`` (created if missing) for this process's life, or raise ``StateDirInUse``.
    ``key`` is the config key that names the folder (``server.state_dir``), for the message. A folder this
    process holds already passes, unless ``again_ok`` is False: daemons on threads (``skyfed.api``) share it."""
    directory = directory.resolve()
    if directory in _held:
        if again_ok:
            return
        raise StateDirInUse(f"{key} {directory} is in use by another daemon of this process: stop it first, or "
                            f"give this one another {key}")  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        who = f"process {holder}" if holder else "another process"
        raise StateDirInUse(
            f"{key} {directory} is in use by {who} (it holds {path}): stop that daemon first, or give this "
            f"one another {key}"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[directory] = fd


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def release_state_dir(directory: Path) -> None:
    """Unlock a folder ``hold_state_dir`` locked, for a daemon that ends before its process (``skyfed.api``)."""
    fd = _held.pop(directory.resolve(), None)
    if fd is not None:
        os.close(fd)
