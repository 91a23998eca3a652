"""The round engine's state as a whole: the model in force, the checkpoint that holds it, and undoing a change
that could not be written.

``RoundEngine`` changes its state in memory, then writes the checkpoint (``checkpoint``). ``durably`` wraps
such a change: if the write fails, the state taken before (``_snapshot``) is installed again (``_install``,
the same path a restart takes), so the server never runs ahead of what a restart would resume
(``broker_server.disk``). ``metrics.jsonl`` and ``global_model.safetensors`` follow the checkpoint
(``flush_outputs``): they may lag behind it, and are brought up to it on the next try.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from broker_server.accountant import PrivacyLedger
from broker_server.checkpoint import Checkpoint, CheckpointStore
from broker_server.config import ServerConfig
from broker_server.disk import DiskError
from broker_server.fallback import Fallback
from broker_server.health import HealthBook
from broker_server.metrics_log import MetricsLog
from broker_server.pace import PaceBook
from flcore.agent_models import Assignment
from flcore.change_bound import ChangeHistory
from flcore.election import BestModel
from flcore.rounds import RoundState
from flcore.strategies.base import Strategy
from flcore.update import float_layout
from flcore.validation import positive_ranges
from models.serialization import save_file
from models.weights import NamedArrays
from security.replay import ReplayGuard


class EngineState:
    """Mixed into ``RoundEngine``: what its checkpoint holds, saved, snapshotted and installed."""

    config: ServerConfig
    store: CheckpointStore
    metrics_log: MetricsLog
    replay: ReplayGuard
    strategy: Strategy
    run_id: str
    version: int
    next_round: int
    round_state: RoundState | None
    global_arrays: NamedArrays
    health: HealthBook
    pace: PaceBook
    ledger: PrivacyLedger
    assignments: dict[str, Assignment]
    best: BestModel
    _last_metrics: dict | None
    model_eval: dict  # the evaluation of the global model in force: what a run's final model scores
    outputs_pending: set[str]  # files that lag behind the checkpoint: "metrics", "model"
    changes: ChangeHistory  # the last committed steps (flcore.change_bound), shared with the pipeline's step
    fallback: Fallback  # the version before the model in force (broker_server.fallback)
    writes = 0  # state writes that succeeded (``broker_server.disk.DiskWatch`` tells the disk is back by it)

    @property
    def settled_writes(self) -> int:
        """State writes that succeeded, or 0 while a file lags behind the checkpoint (the disk is not back)."""
        return 0 if self.outputs_pending else self.writes

    @property
    def model_file(self) -> Path:
        return self.config.state_dir / "global_model.safetensors"

    def _set_model(self, arrays: NamedArrays) -> None:
        self.global_arrays = arrays
        self.float_spec, self.global_vector = float_layout(arrays)
        self.positive = positive_ranges(self.float_spec)

    def adopt(self, arrays: NamedArrays) -> None:
        """Another aggregator's model becomes the one in force (a region takes its root's, ``[upstream]``): a
        new version, checkpointed, and written as ``global_model.safetensors``. The caller checked its layout."""
        self._set_model(arrays)
        self.version += 1
        self.model_eval, self.fallback = {}, Fallback()  # the model before is not this region's to go back to
        self.checkpoint()
        self.outputs_pending.add("model")
        with suppress(DiskError):  # tried again on the daemon's next ticks
            self.flush_outputs()

    def checkpoint(self, last_metrics: dict | None = None) -> None:
        if last_metrics is not None:
            self._last_metrics = last_metrics
        self.store.save(self._snapshot())
        self.writes += 1

    def _snapshot(self, *, replay: bool = True) -> Checkpoint:
        """The state as the checkpoint holds it (the round's lists copied, so that changes to it leave this be)."""
        return Checkpoint(
            run_id=self.run_id,
            next_round=self.next_round,
            model_version=self.version,
            global_arrays=self.global_arrays,
            round_state=self.round_state.copy() if self.round_state is not None else None,
            strategy_state=self.strategy.state(),
            last_metrics=self._last_metrics,
            replay=self.replay.export() if replay else [],
            health=self.health.to_dict(),
            pace=self.pace.to_dict(),
            privacy=self.ledger.to_dict(),
            assignments={a: x.to_dict() for a, x in self.assignments.items()},
            best=self.best.record,
            model_eval=self.model_eval,
            changes=self.changes.to_list(),
            fallback=self.fallback.to_dict(),
        )

    def _install(self, checkpoint: Checkpoint) -> None:
        """Make ``checkpoint`` the state in memory (at start, or to undo a change that was not written). The
        replay guard is not part of it: what it saw stays seen."""
        self.run_id = checkpoint.run_id
        self.version, self.next_round = checkpoint.model_version, checkpoint.next_round
        self.round_state = checkpoint.round_state
        if checkpoint.global_arrays is not getattr(self, "global_arrays", None):
            self._set_model(checkpoint.global_arrays)
        self.strategy.restore(checkpoint.strategy_state)
        self.health = HealthBook.from_dict(checkpoint.health, deadline_s=self.rules.deadline_s)
        self.pace = PaceBook.from_dict(checkpoint.pace)
        self.ledger = PrivacyLedger(self.config.privacy, checkpoint.privacy)
        self.assignments = {a: Assignment.from_dict(x) for a, x in checkpoint.assignments.items()}
        self.best = BestModel(self.store, checkpoint.best)
        self._last_metrics = checkpoint.last_metrics
        # a checkpoint from before ``model_eval``: its last round's evaluation, as it was reported then
        self.model_eval = (checkpoint.last_metrics or {}).get("eval", {}) if checkpoint.model_eval is None \
            else checkpoint.model_eval
        self.changes.norms = ChangeHistory.from_list(checkpoint.changes).norms  # in place: the pipeline holds it
        self.fallback = Fallback.from_dict(checkpoint.fallback)
        if self.round_state is not None:
            self._unfold()

    def fall_back(self) -> int | None:
        """The model before the one in force comes back as a new version (``broker_server.fallback``); returns the
        version it came from, or None when there is none to go back to."""
        arrays = self.store.load_version(self.fallback.version) if self.fallback.version else None
        if arrays is None:
            return None
        came_from, evaluation = self.fallback.version, self.fallback.evaluation
        self._set_model(arrays)
        self.version += 1
        self.model_eval, self.fallback = evaluation, Fallback()
        self.changes.norms = []  # the steps that led to the broken model measure nothing
        self.outputs_pending.add("model")
        return came_from

    def _unfold(self) -> None:
        """Drop the strategy's running sum of the open round: every stored update is re-read at the close."""
        assert self.round_state is not None
        self.strategy.begin(self.global_vector, self.float_spec)
        for record in self.round_state.updates:
            record.folded = 0.0

    @contextmanager
    def durably(self, what: str) -> Iterator[None]:
        """Around a change that ends in a write: if the write fails (``OSError``), the state in memory is put
        back as it was and ``DiskError`` says so, so memory is never ahead of the disk (``broker_server.disk``)."""
        before = self._snapshot(replay=False)
        try:
            yield
        except OSError as exc:
            self._install(before)
            raise DiskError(what, exc) from exc

    def flush_outputs(self) -> None:
        """Bring ``metrics.jsonl`` and ``global_model.safetensors`` up to the checkpoint they follow; a write
        that fails (``DiskError``) is tried again by the next call, never undone."""
        if not self.outputs_pending:
            return
        try:
            if "metrics" in self.outputs_pending:
                self.metrics_log.reconcile(self._last_metrics)
                self.outputs_pending.discard("metrics")
            if "model" in self.outputs_pending:
                save_file(self.model_file, self.global_arrays)
                self.outputs_pending.discard("model")
        except OSError as exc:
            raise DiskError("metrics.jsonl / global_model.safetensors", exc) from exc
        self.writes += 1
