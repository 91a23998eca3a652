"""What ``skyfed server|agent check`` and the daemons' start verify beyond parsing: the state folder is
writable. Runs before PyTorch and Ultralytics are imported, so a bad config fails in a second, not after them.
"""

from __future__ import annotations

import os
from pathlib import Path

from protocol.config import ConfigError


def check_writable_dir(path: Path, key: str, config: Path) -> None:
    """Create ``path`` if needed and write a probe file there; a failure names the key and the fix."""
    probe = path / f".skyfed-write-check-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"{config}: {key} = {str(path)!r}: cannot write there ({exc.strerror or exc}): make it a folder the "
            f"service user can write (e.g. install -d -o skyfed {path}), or set {key} to one"
        ) from None
