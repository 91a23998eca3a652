"""Complete updates into the open round: one at a time, or, while more messages wait in the daemon's inbox, as a
batch whose round state is written once (a group commit).

Every update is still written and synced before the state that lists it (``broker_server.rounds.update_store``),
and nothing that depends on the round happens while a batch is open: the daemon accepts it before a message of
any other kind, before each tick, and as soon as the inbox is empty, so a batch only ever holds updates that
arrived one after another. At the end of a round, when the agents' uploads come in a burst, the state was
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
        """An update just reassembled: accepted now, with those before it, unless more messages wait."""
        self.batch.append(completed)
        if not self.waiting() or len(self.batch) >= BATCH_MAX:
            self.flush()

    def flush(self) -> None:
        batch, self.batch = self.batch, []
        if batch:
            self.accept(*batch)

    def retry(self) -> None:
        """The updates whose acceptance could not be written, once the disk may be back."""
        if self.unsaved:
            self.accept(*self.unsaved.values())

    def accept(self, *updates: Completed) -> None:
        """Accept ``updates`` into the open round with one write of its state, and close the round at once if
        it waits for nobody else (a threshold of K takes exactly K updates)."""
        current = []
        for completed in updates:
            sender = completed.manifest.sender
            self.unsaved.pop(sender, None)
            if self.engine.late.held_for_next_round(sender, completed.manifest.round):  # folded once the next opens
                self.held_late[sender] = completed
            else:
                current.append(completed)
        if not current:
            return
        records: list[UpdateRecord] = []
        refused: set[int] = set()  # by object: one sender's second copy may be refused, its first accepted
        rest: list[Completed] = []  # after the update that completed the round: for what comes after its close
        written = False
        senders = [c.manifest.sender for c in current]
        what = ",".join(senders[:3]) + (f" and {len(senders) - 3} more" if len(senders) > 3 else "")
        with self.disk.writing(self.clock(), self.engine.state.durably(f"update of {what}")):
            with self.engine.state.one_write():
                for i, completed in enumerate(current):
                    try:
                        records.append(self.engine.accept(completed, self.clock()))
                    except UpdateRejected as exc:
                        refused.add(id(completed))
                        self.refusals.refuse(completed.manifest.sender, exc.reason)
                    if self.engine.decide(self.clock()) == "close":  # a threshold of K takes exactly K updates
                        rest = current[i + 1 :]
                        break
            written = True
        if not written:  # undone: kept (one per agent) and accepted again once the disk is back
            self.unsaved.update({c.manifest.sender: c for c in current if id(c) not in refused})
            return
        if records:
            self._log_accepted(records)
        if self.engine.decide(self.clock()) == "close" and self.disk.due(self.clock()):
            self.close(self.clock())
        if rest:
            self.accept(*rest)

    def _log_accepted(self, records: list[UpdateRecord]) -> None:
        rs = self.engine.round_state
        assert rs is not None  # they were accepted into it
        before = len(rs.updates) - len(records)  # each line counts the updates accepted up to it
        for count, record in enumerate(records, start=before + 1):
            log.info("update accepted round=%d agent=%s weight=%d loss=%.4f norm=%.4g folded=%s accepted=%d/%d",
                     rs.round, record.agent, record.samples, record.loss, record.norm, bool(record.folded), count,
                     len(rs.selected))  # fmt: skip
            self.prometheus.update_accepted()  # the retained status waits for its interval: every agent reads it
