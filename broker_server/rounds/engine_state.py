"""The round engine's state as a whole (``RoundEngine.state``): the model in force, the run's counters, the open
round and the books about agents, the checkpoint that holds them, and undoing a change that could not be written.

The engine and its collaborators (``broker_server.rounds.engine_fleet``, ``broker_server.rounds.local_rounds``)
change this object in memory, then write the checkpoint (``checkpoint``). ``durably`` wraps such a change: if the
write fails, the state taken before (``snapshot``) is installed again (``install``, the same path a restart takes),
so the server never runs ahead of what a restart would resume (``broker_server.rounds.disk``). ``metrics.jsonl`` and
``global_model.safetensors`` follow the checkpoint (``flush_outputs``): they may lag behind it, and are brought
up to it on the next try.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

from broker_server.config import ServerConfig
from broker_server.privacy.accountant import PrivacyLedger
from broker_server.rounds.accept import LateWindow
from broker_server.rounds.checkpoint import Checkpoint, CheckpointStore, new_run_id
from broker_server.rounds.disk import DiskError
from broker_server.rounds.fallback import Fallback
from broker_server.rounds.health import HealthBook
from broker_server.rounds.metrics_log import MetricsLog
from broker_server.rounds.pace import PaceBook
from flcore.agent_models import Assignment
from flcore.change_bound import ChangeHistory
from flcore.election import BestModel
from flcore.rounds import RoundState
from flcore.strategies.base import Strategy
from flcore.update import float_layout
from flcore.validation import positive_ranges
from models.serialization import save_file
from models.weights import NamedArrays
from models.zoo import initial_model
from protocol.messages import headline
from security.replay import ReplayGuard

log = logging.getLogger("skyfed.server")


class EngineState:
    """What the checkpoint holds, with the checkpoint store it is saved to; ``open`` loads it or starts a run."""

    def __init__(self, config: ServerConfig, strategy: Strategy, *, replay: ReplayGuard,
                 changes: ChangeHistory) -> None:  # fmt: skip
        self.config, self.strategy, self.replay = config, strategy, replay
        self.store = CheckpointStore(config.state_dir / "checkpoint")
        self.metrics_log = MetricsLog(config.state_dir / "metrics.jsonl")
        self.assignments: dict[str, Assignment] = {}
        self._table: tuple[dict[str, Assignment], dict[str, dict]] | None = None  # ``_assignment_table``'s last
        self.changes = changes  # the last committed steps (flcore.change_bound), shared with the pipeline's step
        self.fallback = Fallback()  # the version before the model in force (broker_server.rounds.fallback)
        # closed rounds whose late updates are still folded in: the last one, or in asynchronous rounds each within
        # rounds.max_staleness versions (flcore.late, flcore.staleness)
        self.late: tuple[LateWindow, ...] = ()
        self.ledger = PrivacyLedger(config.privacy)
        self.health = HealthBook(deadline_s=config.rounds.deadline_s)
        self.pace = PaceBook()
        self.last_metrics: dict | None = None
        self.outputs_pending: set[str] = set()  # files that lag behind the checkpoint: "metrics", "model"
        # state writes that succeeded (``broker_server.rounds.disk.DiskWatch`` tells the disk is back by it)
        self.writes = 0
        self._one_write: bool | None = None  # inside ``one_write``: whether a checkpoint was asked for; None: outside
        self.run_id, self.version, self.next_round = "", 0, 1
        self.round_state: RoundState | None = None
        self.best = BestModel(self.store, {})
        self.model_eval: dict = {}  # the evaluation of the global model in force: what a run's final model scores

    def open(self) -> None:
        """Resume from the checkpoint, or start a run from a new model (``server.model``, ``server.init_weights``)."""
        checkpoint = self.store.load()
        if checkpoint is None:
            server = self.config.server
            initial = initial_model(server.model, server.num_classes, server.seed, self.config.init_weights_path)
            self.run_id, self.version, self.next_round = new_run_id(), 1, 1
            if (kept := self.metrics_log.set_aside()) is not None:
                log.warning("event=earlier-metrics-set-aside file=%s run_id=%s (a new run starts in this state "
                            "folder: its checkpoint is gone)", kept, self.run_id)  # fmt: skip
            self.model_eval = {}  # the initial model is not evaluated: no round has published yet
            self.set_model(initial)
            self.checkpoint()
            save_file(self.model_file, self.global_arrays)
            log.info("server initialised model=%s version=1 run_id=%s", self.config.server.model, self.run_id)
            return
        self.install(checkpoint)
        self.replay.restore(checkpoint.replay)
        if self.round_state is not None and not self.round_state.train:  # a round from before per-agent plans
            self.round_state.train = self.config.training.to_dict()
        if self.assignments and not self.strategy.keeps_models:
            log.warning(
                "strategy %s keeps no agent models: %d assignments dropped", self.strategy.name, len(self.assignments)
            )
            self.assignments = {}
        self.metrics_log.reconcile(checkpoint.last_metrics)
        save_file(self.model_file, self.global_arrays)
        log.info(
            "server resumed run_id=%s version=%d next_round=%d in_round=%s accepted=%s",
            self.run_id,
            self.version,
            self.next_round,
            self.round_state.round if self.round_state else None,
            self.round_state.accepted if self.round_state else [],
        )

    @property
    def held_round(self) -> int:
        """The newest round this state has announced: the open one, else the last."""
        return self.round_state.round if self.round_state is not None else self.next_round - 1

    @property
    def settled_writes(self) -> int:
        """State writes that succeeded, or 0 while a file lags behind the checkpoint (the disk is not back)."""
        return 0 if self.outputs_pending else self.writes

    @property
    def model_file(self) -> Path:
        return self.config.state_dir / "global_model.safetensors"

    def set_model(self, arrays: NamedArrays) -> None:
        self.global_arrays = arrays
        self.float_spec, self.global_vector = float_layout(arrays)
        self.positive = positive_ranges(self.float_spec)

    def adopt(self, arrays: NamedArrays) -> None:
        """Another aggregator's model becomes the one in force (a region takes its root's, ``[upstream]``): a
        new version, checkpointed, and written as ``global_model.safetensors``. The caller checked its layout."""
        self.set_model(arrays)
        self.version += 1
        self.model_eval, self.fallback = {}, Fallback()  # the model before is not this region's to go back to
        self.late = ()  # updates trained from this region's own models are not folded into the root's
        self.checkpoint()
        self.outputs_pending.add("model")
        with suppress(DiskError):  # tried again on the daemon's next ticks
            self.flush_outputs()

    def elect_best(self, export: Callable[[NamedArrays], dict | None]) -> None:
        """The best-evaluated version becomes the final global model (``flcore.election``), a new version, checkpointed
        and written out (``export``: its ONNX file, if the server makes one)."""
        arrays = self.best.elect(self.version)
        if arrays is not None:
            self.set_model(arrays)
            self.version += 1
            self.model_eval = self.best.evaluation()
            self.outputs_pending.add("model")
            self.best.published_as(self.version, export(arrays))
            record = self.best.record
            log.info("best model elected version=%d round=%d score=%.4f published_as=%d", record["version"],
                     record["round"], headline(record), self.version)  # fmt: skip
        self.checkpoint()
        with suppress(DiskError):
            self.flush_outputs()

    def checkpoint(self, last_metrics: dict | None = None) -> None:
        if last_metrics is not None:
            self.last_metrics = last_metrics
        if self._one_write is not None:  # written once, as ``one_write`` ends
            self._one_write = True
            return
        self.store.save(self.snapshot())
        self.writes += 1

    @property
    def writing_once(self) -> bool:
        """Inside ``one_write``: a checkpoint asked for now is written when it ends."""
        return self._one_write is not None

    @contextmanager
    def one_write(self) -> Iterator[None]:
        """The checkpoints asked for inside, written as one when it ends (none if none was asked for): several
        updates accepted in a row, one write of the state (``broker_server.agents.intake``). Inside
        ``durably``: a write that fails undoes them all. A failed disk write (``OSError``) writes nothing, for
        ``durably`` to undo; any other error still writes what was accepted before it, then goes on."""
        if self._one_write is not None:  # nested: the outer one writes
            yield
            return
        self._one_write = False
        try:
            yield
        except OSError:
            self._one_write = None
            raise
        except BaseException:
            self._write_asked()
            raise
        self._write_asked()

    def _write_asked(self) -> None:
        asked, self._one_write = self._one_write, None
        if asked:
            self.checkpoint()

    def snapshot(self, *, replay: bool = True) -> Checkpoint:
        """The state as the checkpoint holds it (the round's lists copied, so that changes to it leave this be)."""
        return Checkpoint(
            run_id=self.run_id,
            next_round=self.next_round,
            model_version=self.version,
            global_arrays=self.global_arrays,
            round_state=self.round_state.copy() if self.round_state is not None else None,
            strategy_state=self.strategy.state(),
            last_metrics=self.last_metrics,
            replay=self.replay.export() if replay else [],
            health=self.health.to_dict(),
            pace=self.pace.to_dict(),
            privacy=self.ledger.to_dict(),
            assignments=self._assignment_table(),
            best=self.best.record,
            model_eval=self.model_eval,
            changes=self.changes.to_list(),
            fallback=self.fallback.to_dict(),
            late=[w.to_dict() for w in self.late],
        )

    def _assignment_table(self) -> dict[str, dict]:
        """Every agent's assignment as the checkpoint holds it: the same table (the same object, which the store
        then does not write again) while the assignments are unchanged. The checkpoint is written at every
        accepted update and assignments change only when a round ends; with thousands of agents, turning them all
        into dicts and writing them at every update cost more than the agents' training (docs/results/swapping.md)."""
        if self._table is not None and self._table[0] == self.assignments:
            return self._table[1]
        self._table = (dict(self.assignments), {agent: x.to_dict() for agent, x in self.assignments.items()})
        return self._table[1]

    def install(self, checkpoint: Checkpoint) -> None:
        """Make ``checkpoint`` the state in memory (at start, or to undo a change that was not written). The
        replay guard is not part of it: what it saw stays seen."""
        self.run_id = checkpoint.run_id
        self.version, self.next_round = checkpoint.model_version, checkpoint.next_round
        self.round_state = checkpoint.round_state
        if checkpoint.global_arrays is not getattr(self, "global_arrays", None):
            self.set_model(checkpoint.global_arrays)
        self.strategy.restore(checkpoint.strategy_state)
        self.health = HealthBook.from_dict(checkpoint.health, deadline_s=self.config.rounds.deadline_s)
        self.pace = PaceBook.from_dict(checkpoint.pace)
        self.ledger = PrivacyLedger(self.config.privacy, checkpoint.privacy)
        self.assignments = {a: Assignment.from_dict(x) for a, x in checkpoint.assignments.items()}
        self.best = BestModel(self.store, checkpoint.best)
        self.last_metrics = checkpoint.last_metrics
        # a checkpoint from before ``model_eval``: its last round's evaluation, as it was reported then
        self.model_eval = (checkpoint.last_metrics or {}).get("eval", {}) if checkpoint.model_eval is None \
            else checkpoint.model_eval
        self.changes.norms = ChangeHistory.from_list(checkpoint.changes).norms  # in place: the pipeline holds it
        self.fallback = Fallback.from_dict(checkpoint.fallback)
        late = checkpoint.late  # one window (a dict) in checkpoints from before asynchronous rounds
        self.late = tuple(LateWindow.from_dict(w) for w in ([late] if isinstance(late, dict) else late) if w)
        if self.round_state is not None:
            self.unfold()

    def fall_back(self) -> int | None:
        """The model before the one in force comes back as a new version (``broker_server.rounds.fallback``);
        returns the version it came from, or None when there is none to go back to."""
        arrays = self.store.load_version(self.fallback.version) if self.fallback.version else None
        if arrays is None:
            return None
        came_from, evaluation = self.fallback.version, self.fallback.evaluation
        self.set_model(arrays)
        self.version += 1
        self.model_eval, self.fallback = evaluation, Fallback()
        self.changes.norms = []  # the steps that led to the broken model measure nothing
        self.late = ()  # nor do late updates trained from it: refused as late
        self.outputs_pending.add("model")
        return came_from

    def unfold(self) -> None:
        """Drop the strategy's running sum of the open round: every stored update is re-read at the close."""
        assert self.round_state is not None
        self.strategy.begin(self.global_vector, self.float_spec)
        self.round_state.updates = [replace(record, folded=0.0) for record in self.round_state.updates]

    @contextmanager
    def durably(self, what: str) -> Iterator[None]:
        """Around a change that ends in a write: if the write fails (``OSError``), the state in memory is put
        back as it was and ``DiskError`` says so, so memory is never ahead of the disk
        (``broker_server.rounds.disk``)."""
        before = self.snapshot(replay=False)
        try:
            yield
        except OSError as exc:
            self.install(before)
            raise DiskError(what, exc) from exc

    def flush_outputs(self) -> None:
        """Bring ``metrics.jsonl`` and ``global_model.safetensors`` up to the checkpoint they follow; a write
        that fails (``DiskError``) is tried again by the next call, never undone."""
        if not self.outputs_pending:
            return
        try:
            if "metrics" in self.outputs_pending:
                self.metrics_log.reconcile(self.last_metrics)
                self.outputs_pending.discard("metrics")
            if "model" in self.outputs_pending:
                save_file(self.model_file, self.global_arrays)
                self.outputs_pending.discard("model")
        except OSError as exc:
            raise DiskError("metrics.jsonl / global_model.safetensors", exc) from exc
        self.writes += 1


class StateField:
    """A field of an owner's ``state`` (``EngineState``), read through the owner: ``engine.version`` is
    ``engine.state.version``. Writing it through the owner is an error: the state is changed where it is held."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, owner: Any, kind: type | None = None) -> Any:
        return self if owner is None else getattr(owner.state, self.name)

    def __set__(self, owner: Any, value: object) -> None:
        raise AttributeError(f"{self.name} is the state's: set state.{self.name}")
