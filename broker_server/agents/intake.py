"""Complete updates into the open round: one at a time, or, while more messages wait in the daemon's inbox, as a
batch whose round state is written once (a group commit).

Every update is still written and synced before the state that lists it (``broker_server.rounds.update_store``),
and nothing that depends on the round happens while a batch is open: the daemon accepts it before a message of
any other kind than an update or a status that changes nothing of the round (``Aggregator._on_status``), before
each tick, and as soon as the inbox is empty, so a batch only ever holds updates that arrived one after another,
with agents' statuses between them. At the end of a round, when the agents' uploads come in a burst, the state was
rewritten and synced once per update (docs/results/scale.md); now once per burst of up to ``BATCH_MAX``. A
write that fails undoes the whole batch (``EngineState.durably``), and its updates are accepted again once the
disk is back, as a single one's are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker_server.agents.refusals import Refusals
from broker_server.rounds.disk import DiskWatch
from broker_server.rounds.engine import RoundEngine
from broker_server.watch.prometheus import ServerMetrics
from flcore.rounds import UpdateRecord
from flcore.update import UpdateRejected
from protocol.transfer import Completed

log = logging.getLogger("skyfed.server")

BATCH_MAX = 64  # updates in one write: bounds what a failed write undoes and how long the first one waits
BATCH_BYTES = 64 << 20  # and their plaintexts held at once, past the reassembler's own limit on transfers


class UpdateIntake:
    """``waiting`` says whether more messages wait in the daemon's inbox; ``close`` closes the round (the
    daemon's, which publishes what the close produced)."""

    def __init__(self, engine: RoundEngine, *, disk: DiskWatch, refusals: Refusals, prometheus: ServerMetrics,
                 clock: Callable[[], float], waiting: Callable[[], bool],
                 close: Callable[[float], None]) -> None:  # fmt: skip
        self.engine, self.disk, self.refusals, self.prometheus = engine, disk, refusals, prometheus
        self.clock, self.waiting, self.close = clock, waiting, close
        self.unsaved: dict[str, Completed] = {}  # authenticated updates whose acceptance could not be written
        self.held_late: dict[str, Completed] = {}  # late updates that arrived between two rounds (flcore.late)
        self.batch: list[Completed] = []

    def add(self, completed: Completed) -> None:
        """An update just reassembled: accepted now, with those before it, unless more messages wait and the round
        still waits for others than the batch's senders (``RoundEngine.complete_with``). A second
        copy from a sender already in the batch first lets the batch in, so the round's gates refuse the next
        copies at their first chunk, as before."""
        if any(c.manifest.sender == completed.manifest.sender for c in self.batch):
            self.flush()
        self.batch.append(completed)
        full = len(self.batch) >= BATCH_MAX or sum(c.wire_bytes for c in self.batch) >= BATCH_BYTES
        if full or not self.waiting() or self.engine.complete_with(frozenset(c.manifest.sender for c in self.batch)):
            self.flush()  # the last: the round closes now, not at the next tick (statuses keep the inbox busy)

    def flush(self) -> None:
        batch, self.batch = self.batch, []
        if batch:
            self.accept(*batch)

    def retry(self) -> None:
        """The updates whose acceptance could not be written, once the disk may be back."""
        if self.unsaved:
            self.accept(*self.unsaved.values())

    def accept(self, *updates: Completed) -> None:
        """Accept ``updates`` into the open round, ``BATCH_MAX`` at a time with one write of its state each, and
        close the round as soon as it waits for nobody else: a threshold of K takes exactly K updates, and the
        ones after them meet the round that follows (held late, folded, or refused, as if they came after)."""
        pending = list(updates)
        while pending:
            batch, pending = pending[:BATCH_MAX], pending[BATCH_MAX:]
            pending = self._accept_batch(batch) + pending

    def _accept_batch(self, updates: list[Completed]) -> list[Completed]:
        """One write for ``updates`` (or for those up to the one that completes the round); returns the rest."""
        current = []
        for completed in updates:
            sender = completed.manifest.sender
            self.unsaved.pop(sender, None)
            if self.engine.late.held_for_next_round(sender, completed.manifest.round):  # folded once the next opens
                self.held_late[sender] = completed
            else:
                current.append(completed)
        if not current:
            return []
        records: list[UpdateRecord] = []
        refused: list[tuple[str, str]] = []  # refusals said once the batch is written: undone, they are not
        rest: list[Completed] = []
        written = False
        senders = [c.manifest.sender for c in current]
        what = ",".join(senders[:3]) + (f" and {len(senders) - 3} more" if len(senders) > 3 else "")
        with self.disk.writing(self.clock(), self.engine.state.durably(f"update of {what}")):
            with self.engine.state.one_write():
                for i, completed in enumerate(current):
                    try:
                        records.append(self.engine.accept(completed, self.clock()))
                    except UpdateRejected as exc:
                        refused.append((completed.manifest.sender, exc.reason))
                    except OSError:
                        raise  # the disk: ``durably`` undoes the batch
                    except Exception:  # noqa: BLE001 - one update's bug must not lose the rest of the batch
                        log.exception("update not accepted round=%d agent=%s: internal error",
                                      completed.manifest.round, completed.manifest.sender)  # fmt: skip
                    if self.engine.decide(self.clock()) == "close":  # a threshold of K takes exactly K updates
                        current, rest = current[: i + 1], current[i + 1 :]
                        break
            written = True
        if not written:  # undone: kept (one per agent) and accepted again once the disk is back
            for completed in current:
                self.unsaved.setdefault(completed.manifest.sender, completed)
            return []
        for sender, reason in refused:
            self.refusals.refuse(sender, reason)
        if records:
            self._accepted(records)
        if self.engine.decide(self.clock()) == "close" and self.disk.due(self.clock()):
            self.close(self.clock())
        return rest

    def _accepted(self, records: list[UpdateRecord]) -> None:
        """Say each accepted update, and do now what the close would do with it (``RoundEngine.on_accepted``)."""
        rs = self.engine.round_state
        assert rs is not None  # they were accepted into it
        before = len(rs.updates) - len(records)  # each line counts the updates accepted up to it
        for count, record in enumerate(records, start=before + 1):
            log.info("update accepted round=%d agent=%s weight=%d loss=%.4f norm=%.4g folded=%s accepted=%d/%d",
                     rs.round, record.agent, record.samples, record.loss, record.norm, bool(record.folded), count,
                     len(rs.selected))  # fmt: skip
            self.prometheus.update_accepted()  # the retained status waits for its interval: every agent reads it
        for record in records:
            if not record.late_from:
                self.engine.on_accepted(record.agent)
