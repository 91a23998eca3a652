"""The replay guard forgets in insertion order (O(1) per transfer) and never grows past its cap."""

from dataclasses import dataclass

from security import replay
from security.replay import ReplayGuard


@dataclass(frozen=True)
class Seen:
    transfer_id: bytes
    created_at: float
    sender: str = "agent"


def test_entries_leave_once_outside_the_window_and_the_export_keeps_the_newest():
    now = [1000.0]
    guard = ReplayGuard(max_age_s=100, clock=lambda: now[0])
    for i in range(10):
        guard.remember(Seen(bytes([i]) * 16, created_at=now[0] + i))
    now[0] += 105  # the first five are now outside the window
    guard.remember(Seen(b"\xff" * 16, created_at=now[0]))
    assert len(guard) == 6 and not guard.seen(bytes([0]) * 16) and guard.seen(bytes([9]) * 16)
    assert [e[0] for e in guard.export(limit=2)] == [(bytes([9]) * 16).hex(), (b"\xff" * 16).hex()]
    restored = ReplayGuard(max_age_s=100, clock=lambda: now[0])
    restored.restore(guard.export())
    assert restored.seen(bytes([7]) * 16)


def test_a_flood_inside_the_window_is_capped(monkeypatch):
    monkeypatch.setattr(replay, "MAX_ENTRIES", 1000)
    guard = ReplayGuard(max_age_s=3600, clock=lambda: 0.0)
    for i in range(5000):
        guard.remember(Seen(i.to_bytes(16, "big"), created_at=0.0))
    assert len(guard) == 1000 and guard.seen((4999).to_bytes(16, "big")) and not guard.seen(bytes(16))


def test_one_senders_flood_does_not_push_the_others_out_of_the_checkpoint():
    """Found by the hostile review: the export kept the newest 4096 ids of anyone, so a pending agent that
    sent thousands of junk updates left no honest transfer in the checkpoint to refuse after a restart."""
    guard = ReplayGuard(max_age_s=3600, clock=lambda: 0.0)
    guard.remember(Seen(b"honest".ljust(16, b"\0"), created_at=0.0, sender="agent-01"))
    for i in range(5000):
        guard.remember(Seen(i.to_bytes(16, "big"), created_at=0.0, sender="rogue"))
    exported = guard.export()
    assert len(exported) == replay.EXPORT_PER_SENDER + 1 and exported[0][2] == "agent-01"
    restored = ReplayGuard(max_age_s=3600, clock=lambda: 0.0)
    restored.restore(exported + [[bytes(16).hex(), 0.0]])  # and a line of a checkpoint written before
    assert restored.seen(b"honest".ljust(16, b"\0")) and restored.seen(bytes(16))
