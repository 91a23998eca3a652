"""Files a store has released, written over by its next writes instead of new files (``atomic_write``'s ``reuse``).

The server writes one file per accepted update and, for the strategies that keep per-agent models, one per kept
model: at 100 agents x 3.2M values, 1.28 GB of new files a round, each fsynced before the checkpoint that names
it. On the development VM's ext4 a new file's blocks cost far more than the bytes: writing 100 files of 12.8 MB
with fsync took 1.6-2.6 s as new files and 0.53 s written over released ones (docs/architecture.md, "The
server's files"). PostgreSQL recycles its write-ahead-log segments for the same reason (``wal_recycle``: renaming
an old segment "avoids the need to create new ones"); on copy-on-write file systems it gains nothing, and costs
nothing but the disk it holds.

The spares are the files released at the last commit that released any (a save that releases none keeps them):
``release`` deletes those nobody wrote over since and keeps the new ones, so a store never holds more than at its
fullest (the old round's files and the new round's together, just before a commit). A spare is only ever renamed
to a temporary name and written over, never read; a view of a store's file (a memory map) is therefore good only
until the file is released.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path


class SpareFiles:
    FOLDER = ".spare"

    def __init__(self, store: Path) -> None:
        """Spares of the store whose folder is ``store``, kept in its ``FOLDER``; those found there (from before a
        restart) are used first."""
        self.directory = store / self.FOLDER
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # a store's writes may come from several threads
        self._free = sorted(self.directory.iterdir())

    def take(self) -> Path | None:
        """A spare to write over (``atomic_write(..., reuse=)``), or None: write a new file."""
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, paths: list[Path]) -> None:
        """Keep ``paths`` (files of the store that nothing names any more) as the spares, and delete the spares
        nobody wrote over since the last release (a writer that took one meanwhile writes a new file). Nothing
        to release keeps the spares there are."""
        if not paths:
            return
        with self._lock:
            self._free = []
        for path in self.directory.iterdir():
            path.unlink(missing_ok=True)
        kept = []
        for path in paths:
            spare = self.directory / secrets.token_hex(8)
            try:
                os.replace(path, spare)
            except FileNotFoundError:
                continue
            kept.append(spare)
        with self._lock:
            self._free += kept
