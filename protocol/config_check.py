"""What ``skyfed server|agent check`` and the daemons' start verify beyond parsing: the state folder is
writable. Runs before PyTorch and Ultralytics are imported, so a bad config fails in a second, not after them.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from protocol.config import ConfigError


class DaemonConfig(Protocol):
    state_dir: Path


C = TypeVar("C", bound=DaemonConfig)


def check_writable_dir(path: Path, key: str, config: Path, *, create: bool = True) -> None:
    """Write a probe file in ``path`` (made first when ``create``; else, while it does not exist, the folder
    it would be made in must be writable); a failure names the key and the fix."""
    probe = path / f".skyfed-write-check-{os.getpid()}"
    try:
        if not create and not path.exists():
            parent = next(p for p in path.parents if p.exists())
            if not parent.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
            if not os.access(parent, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(parent))
            return
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"{config}: {key} = {str(path)!r}: cannot write there ({exc.strerror or exc}): make it a folder the "
            f"service user can write (e.g. install -d -o skyfed {path}), or set {key} to one"
        ) from None


def load_checked(load: Callable[[Path], C], path: Path, key: str, *, create: bool = True) -> C:
    """The config at ``path`` parsed and its state folder (``key``) writable: all that is checked before the
    heavy imports, by ``skyfed server|agent run`` (which make the folder) and ``check`` (which makes nothing)."""
    config = load(path)
    check_writable_dir(config.state_dir, key, path, create=create)
    return config


def report_check(command: str, load: Callable[[], C], summary: Callable[[C], str],
                 warnings: Callable[[C], list[str]] = lambda _: []) -> int:  # fmt: skip
    """``skyfed server|agent check``: ``ok: <summary>`` and any warnings, exit 0; or the error, which names
    the key and the fix, on stderr, exit 2."""
    try:
        config = load()
    except ConfigError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    print(f"ok: {summary(config)}")
    for warning in warnings(config):
        print(f"warning: {warning}")
    return 0
