"""Replay protection: remember finished transfers for as long as their age window accepts them.

An envelope older than ``max_age_s`` is refused as expired anyway, so a transfer id only has to be
remembered for that long: memory is bounded by the traffic of one window. ``export``/``restore`` let a
node keep the guard in its checkpoint, so a restart does not reopen the window.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol


class HasTransferId(Protocol):
    transfer_id: bytes
    created_at: float


class ReplayGuard:
    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.time) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def seen(self, transfer_id: bytes) -> bool:
        return transfer_id in self._seen

    def remember(self, manifest: HasTransferId) -> None:
        self._seen[manifest.transfer_id] = manifest.created_at
        self._seen.move_to_end(manifest.transfer_id)
        horizon = self.clock() - self.max_age_s
        for tid, created in list(self._seen.items()):
            if created < horizon:
                del self._seen[tid]

    def export(self) -> list[list]:
        """``[[transfer id hex, created_at], …]`` of the transfers still inside the window."""
        horizon = self.clock() - self.max_age_s
        return [[tid.hex(), created] for tid, created in self._seen.items() if created >= horizon]

    def restore(self, entries: list[list]) -> None:
        for tid, created in entries:
            self._seen[bytes.fromhex(tid)] = float(created)

    def __len__(self) -> int:
        return len(self._seen)
