"""The accepted updates of the open round, one durable file each, read back without copying.

An update is written (fsync, atomic rename) before the round state that lists it, so after a
``kill -9`` at any instant every update the checkpoint names is on disk. Strategies read them back
through read-only memory maps: the page cache, not the server's heap, holds them, and a strategy that
needs every update of the round (median, Krum) costs disk, not RAM. Files of other rounds are released
when a round is committed or rolled back, to be written over by the next round's updates
(``common.spare_files``).
"""

from __future__ import annotations

import mmap
import shutil
from pathlib import Path

import numpy as np

from common.files import atomic_write
from common.spare_files import SpareFiles
from models.serialization import float32_region


class UpdateStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.spares = SpareFiles(directory)

    def path(self, round_number: int, agent: str) -> Path:
        return self.directory / f"round-{round_number}" / f"{agent}.safetensors"

    def put(self, round_number: int, agent: str, data: bytes | bytearray | memoryview) -> None:
        atomic_write(self.path(round_number, agent), data, mode=0o600, reuse=self.spares.take())

    def delta(self, round_number: int, agent: str) -> np.ndarray:
        """The stored update's float32 delta as a read-only view of the file (validated when accepted), good until
        its round's files are released."""
        with open(self.path(round_number, agent), "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        vector, _, _ = float32_region(mapped)
        return vector

    def keep_only(self, round_number: int | None) -> None:
        """Release every other round's files to the spares (``common.spare_files``) and delete their folders."""
        keep = {None if round_number is None else f"round-{round_number}", self.spares.directory.name}
        old = [path for path in self.directory.iterdir() if path.name not in keep]
        self.spares.release([file for path in old if path.is_dir() for file in path.iterdir()])
        for path in old:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
