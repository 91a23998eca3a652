"""Replay protection: remember finished transfers for as long as their age window accepts them.

An envelope older than ``max_age_s`` is refused as expired anyway, so a transfer id only has to be
remembered for that long: memory is bounded by the traffic of one window, and by ``MAX_ENTRIES``.
``export``/``restore`` let a node keep the guard in its checkpoint, so a restart does not reopen it; the
export keeps at most ``EXPORT_PER_SENDER`` ids per sender, so one sender's flood of transfers cannot push
everyone else's out of the checkpoint.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

MAX_ENTRIES = 500_000  # about 50 MB; past it the oldest are forgotten first (round binding still applies)
EXPORT_PER_SENDER = 256  # an honest agent finishes a few transfers a round


class HasTransferId(Protocol):
    transfer_id: bytes
    created_at: float
    sender: str


class ReplayGuard:
    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.time) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self._seen: OrderedDict[bytes, tuple[float, str]] = OrderedDict()  # id → (created_at, sender)

    def seen(self, transfer_id: bytes) -> bool:
        return transfer_id in self._seen

    def remember(self, manifest: HasTransferId) -> None:
        """O(1) amortised: entries leave from the oldest-remembered end once outside the window."""
        self._seen[manifest.transfer_id] = (manifest.created_at, manifest.sender)
        self._seen.move_to_end(manifest.transfer_id)
        horizon = self.clock() - self.max_age_s
        while self._seen:
            tid, (created, _) = next(iter(self._seen.items()))
            if created >= horizon and len(self._seen) <= MAX_ENTRIES:
                break
            del self._seen[tid]

    def export(self, limit: int = 4096) -> list[list]:
        """``[[transfer id hex, created_at, sender], …]``: the ``limit`` most recently remembered transfers
        still inside the window, at most ``EXPORT_PER_SENDER`` of each sender (a node checkpoints this
        often; a flood must not make each write huge, nor crowd the other senders out)."""
        horizon = self.clock() - self.max_age_s
        per_sender: dict[str, int] = {}  # not a Counter: its Python ``__missing__`` ran for each new sender
        recent = []
        for tid, (created, sender) in itertools.islice(reversed(self._seen.items()), 16 * limit):  # bounded work
            if len(recent) == limit:
                break
            taken = per_sender.get(sender, 0)
            if created >= horizon and taken < EXPORT_PER_SENDER:
                per_sender[sender] = taken + 1
                recent.append([tid.hex(), created, sender])
        return recent[::-1]

    def restore(self, entries: list[list]) -> None:
        for tid, created, *sender in entries:  # checkpoints before the sender was kept have none
            self._seen[bytes.fromhex(tid)] = (float(created), sender[0] if sender else "")

    def __len__(self) -> int:
        return len(self._seen)
