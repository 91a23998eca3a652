"""The round engine: rounds from start to commit, with all state that must survive a restart. No I/O
but files: the daemon turns its results into MQTT messages, so the engine can be driven in tests.

Lifecycle (docs/architecture.md): ``begin_round`` selects agents, ``announce`` (re)opens the round until a
deadline, ``accept`` takes updates (``broker_server.rounds.accept``), ``decide`` says when to close, and
``close`` runs the pipeline (``broker_server.rounds.pipeline``) then either **commits** (checkpoint first, then
``metrics.jsonl`` and ``global_model.safetensors``; the daemon publishes afterwards) or **rolls back**
(the previous model stays; the round is recorded with its reason and offenders). The checkpoint is
written after every accepted update and every finished round; a change whose checkpoint cannot be
written is undone (``state.durably``), so memory is never ahead of the disk.

The engine holds collaborators, each with its own job: ``state`` (``broker_server.rounds.engine_state``: what the
checkpoint holds, saved and undone), ``fleet`` (``broker_server.rounds.engine_fleet``: what agents do to the open round
unasked) and ``local`` (``broker_server.rounds.local_rounds``: model swapping's rounds without uploads) and ``late``
(``broker_server.rounds.late_folds``: the round before's late updates, folded into the open one). The state's
fields the daemon and the sim read most (``round_state``, ``version``, …) read through the engine.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import suppress

import numpy as np

from broker_server.config import ServerConfig
from broker_server.pool import POOL
from broker_server.rounds.accept import LateWindow, accept_update
from broker_server.rounds.async_rounds import AsyncRounds, buffer_metrics
from broker_server.rounds.disk import DiskError
from broker_server.rounds.engine_fleet import FleetEvents
from broker_server.rounds.engine_state import EngineState, StateField
from broker_server.rounds.fallback import Fallback, broken_model, stuck_reason
from broker_server.rounds.keep_step import KeepAgentModels
from broker_server.rounds.late_folds import LateFolds
from broker_server.rounds.local_rounds import LocalRounds
from broker_server.rounds.metrics_log import round_metrics
from broker_server.rounds.onnx_step import ExportOnnx
from broker_server.rounds.personal import GLOBAL, StartScores
from broker_server.rounds.pipeline import RoundContext, RoundRejected, run_pipeline
from broker_server.rounds.round_steps import round_steps
from flcore.agent_models import Assignment, settle
from flcore.change_bound import ChangeHistory
from flcore.rounds import RoundState, UpdateRecord, complete, decide, replace_missing, select_with_probation
from flcore.strategies import build_strategy
from flcore.strategies.choice import strategy_notes
from flcore.update import NotForThisRound, UpdateRejected
from flcore.validation import reason_kind, worth_listing
from models.weights import NamedArrays, state_spec, with_floats
from models.zoo import build_model
from participant.recipes import checked_settings, work_share
from protocol.codecs import Codec
from protocol.messages import Rejection, RoundMetrics, TrainSettings
from protocol.transfer import Completed
from security.keys import Keyring
from security.replay import ReplayGuard

log = logging.getLogger("skyfed.server")

WASTED = ("late", "stale", "one-per-buffer")  # refusals of a trained update for its timing, not its content


class RoundEngine:
    # the state's fields, read through the engine; only the engine and its collaborators change them (``state``)
    round_state, run_id, version, next_round, model_eval, best = (StateField() for _ in range(6))
    global_arrays, global_vector, float_spec, assignments, health, ledger = (StateField() for _ in range(6))

    def __init__(
        self,
        config: ServerConfig,
        *,
        replay: ReplayGuard,
        evaluator: Callable[[NamedArrays], dict[str, float]] | None = None,
    ) -> None:
        self.config = config
        self.rules = config.rounds
        self.policy = config.privacy.bounds(config.bounds)
        self.codec = Codec.parse(config.server.codec)
        table, notes = config.privacy.strategy_table(config.strategy)  # under privacy: fedavg by default
        self.strategy = build_strategy(table)
        self.strategy.last_round = config.server.rounds
        # C-GEN of the models agents are judged by: only where the server holds them (not agents' own models)
        judged_here = self.strategy.models == "global" or self.strategy.keeps_models
        self.start_scores = StartScores(evaluator if judged_here else None)
        for note in notes + strategy_notes(table, len(Keyring.load_dir(config.enrolled_dir).names()), config.rounds):
            log.log(note.level, "%s", note.text)
        self.changes = ChangeHistory()
        self.state = EngineState(config, self.strategy, replay=replay, changes=self.changes)
        self.fleet = FleetEvents(self.state, reject=self.reject)
        self.local = LocalRounds(self.state, needs_global=self.needs_global)
        self.late = LateFolds(self.state, self.strategy, config.rounds)
        self.buffer = AsyncRounds(self.state, config.rounds, config.server.seed)
        self.steps = round_steps(config, self.strategy, self.policy, self.state.store.agents, self.base_vector,
                                 lambda: self.state.assignments, self._round_rng, evaluator,
                                 lambda: self.state.ledger.clip, self.changes, self._in_force_eval)  # fmt: skip
        self.keeper = next((step for step in self.steps if isinstance(step, KeepAgentModels)), None)
        config.privacy.configure(self.strategy)
        self.budget_exhausted = False  # too few agents can afford another round (differential privacy)
        self.orphan_rejections: list[dict[str, str]] = []
        self.orphan_wasted: dict[str, list[str]] = {}  # updates lost between two rounds, counted in the next
        self.state.open()
        if self.model_eval:  # the model in force, evaluated when it was published: agents start from it next
            self.start_scores.known(f"{GLOBAL}-v{self.version}", self.model_eval)
        if problem := self.strategy.fit_model(lambda: state_spec(build_model(config.server.model,
                                                                             num_classes=config.server.num_classes))):
            raise ValueError(f"strategy {self.strategy.name}: {problem}")
        if self.finished:
            log.warning("this run is already over (%d rounds done): to start a new run, move %s aside, or raise "
                        "server.rounds to go on with this one", self.next_round - 1, self.config.state_dir)  # fmt: skip
            if self.strategy.elect_best and not self.best.elected:
                self._elect_best()  # the run ended just before a crash: elect now

    # agents' own models ------------------------------------------------------------------------------
    def base_vector(self, agent: str) -> np.ndarray:
        """The float vector ``agent`` trains from this round: its assigned model, else the global one."""
        return self._vector_of(self.assignments.get(agent))

    def _vector_of(self, assignment: Assignment | None) -> np.ndarray:
        return self.global_vector if assignment is None else self.state.store.agents.vector(assignment.model)

    def start_model(self, agent: str) -> NamedArrays:
        """The whole model ``agent`` starts from (what its inbox gets when it is not the global one)."""
        return with_floats(self.global_arrays, self.base_vector(agent), self.float_spec)

    def _trained_limit(self) -> int:
        """How many trained models a round scores (none under privacy: ``broker_server.rounds.personal``)."""
        return 0 if self.config.privacy.enabled else self.config.server.score_trained

    def _trained_model(self, agent: str) -> NamedArrays:
        """``agent``'s model after this round's training: its start model plus the change it uploaded."""
        assert self.round_state is not None
        vector = self.base_vector(agent) + self.state.store.updates.delta(self.round_state.round, agent)
        return with_floats(self.global_arrays, vector, self.float_spec)

    def needs_global(self, agent: str) -> bool:
        """Whether ``agent`` trains with the global model this round: it starts from it, or attends over it."""
        assignment = self.assignments.get(agent)
        return assignment is None or assignment.peers is not None

    def peer_bundle(self, agent: str) -> NamedArrays | None:
        """The models ``agent``'s trainer attends over this round (``agent_models.Peers``), if it has any."""
        assignment = self.assignments.get(agent)
        if assignment is None or assignment.peers is None:
            return None
        return self.state.store.agents.bundle(assignment.peers, self.float_spec)

    def _round_rng(self) -> np.random.Generator:
        assert self.round_state is not None
        return np.random.default_rng([self.config.server.seed, self.round_state.round])

    @property
    def finished(self) -> bool:
        limit = self.config.server.rounds
        return self.round_state is None and (self.budget_exhausted or limit > 0 and self.next_round > limit)

    # rounds ------------------------------------------------------------------------------------------
    def begin_round(self, eligible: list[str], now: float, enrolled: list[str] | None = None,
                    busy: set[str] | None = None, held: bool = False) -> RoundState | None:  # fmt: skip
        """Open the next round if enough agents are eligible; the caller then announces it. Backed-off
        agents are left out while enough others are eligible; selected only to make up ``min_agents``,
        they are on probation: the round does not wait for them (backing off never stops a federation).
        Under privacy, agents without budget for a round are left out, and once fewer than
        ``rounds.min_agents`` of the ``enrolled`` (default: the eligible) have budget, the run ends. The
        shared pool (``broker_server.pool.shared``) joins, within its budget, every round its agents open. An
        asynchronous round (``broker_server.rounds.async_rounds``) opens on one idle agent, ``busy`` ones left out,
        or on none when late updates are ``held`` for it (they fill its buffer)."""
        if self.round_state is not None or self.finished:
            return None
        if self.config.privacy.enabled:
            everyone = self.ledger.affordable(eligible if enrolled is None else enrolled)
            if len(everyone) < self.rules.min_agents:
                self._end_for_budget(len(everyone))
                return None
            eligible = self.ledger.affordable(eligible)
        number = self.next_round
        available = self.health.available(eligible, number, now)
        if self.rules.is_async:
            selected, probation = self.buffer.select(available, busy or set(), number), []
            if not selected and not held:
                return None
        elif len(eligible) < self.rules.min_agents:
            return None
        else:
            seed = self.config.server.seed * 100_003 + number
            selected, probation = select_with_probation(eligible, available, self.rules, seed)
        plan = self.strategy.configure_train(self.config.training, number, self.state.pace.of(selected))
        if self.config.pool.enabled and self.ledger.affords_a_round(POOL):  # the shared pool: one more participant
            selected = [*selected, POOL]
        self.state.round_state = RoundState(
            round=number,
            attempt=0,
            selected=selected,
            deadline=0.0,
            started_at=now,
            action=self.strategy.action(number),
            train=checked_settings(plan.shared).to_dict(),
            agent_train={agent: checked_settings(settings).to_dict() for agent, settings in plan.agents.items()
                         if agent in selected},
            probation=probation,
        )
        self.round_state.rejected.extend(self.orphan_rejections)
        self.round_state.wasted = {kind: list(agents) for kind, agents in self.orphan_wasted.items()}
        self.round_state.revoked.extend(self.fleet.take_revoked())
        self.orphan_rejections.clear()
        self.orphan_wasted.clear()
        self.strategy.begin(self.global_vector, self.float_spec)
        return self.round_state

    def announce(self, now: float, *, keep_deadline: bool = False, latest: float | None = None) -> RoundState:
        """Start (or restart) the open round's attempt: the pending agents asked again, by a new deadline
        (or by the one they had: a round resumed after the broker came back), no later than ``latest``."""
        rs = self.round_state
        assert rs is not None
        rs.attempt += 1
        if not keep_deadline:
            rs.deadline = min(now + self.rules.deadline_s, latest or math.inf)
        self.state.checkpoint()
        return rs

    def replace_missing(self, eligible: list[str], now: float) -> tuple[list[str], list[str]]:
        """The deadline passed without quorum: back off every pending agent, and let eligible agents that
        are not backed off stand in for them (``rounds.replace_missing``). Returns ``(excused, stand_ins)``."""
        rs = self.round_state
        assert rs is not None
        if not self.rules.is_async:  # an asynchronous round's pending agents may still be training: not missed
            self.health.back_off(rs.pending, rs.round, "missed the deadline", now)
        seed = self.config.server.seed * 100_003 + rs.round * 101 + rs.attempt
        candidates = self.ledger.affordable(self.health.available(eligible, rs.round, now))
        # under privacy, only agents with budget
        excused, stand_ins = replace_missing(rs, candidates, seed, self.rules.quorum)
        if stand_ins:
            log.warning("round %d: %s stand in for %s", rs.round, ",".join(stand_ins), ",".join(excused))
        return excused, stand_ins

    def decide(self, now: float) -> str:
        if self.round_state is None:
            return "idle"
        return decide(self.round_state, self.rules, now, self.strategy.threshold)

    def complete_with(self, senders: frozenset[str]) -> bool:
        """Whether the open round has what it waits for once the updates of ``senders`` are in."""
        return self.round_state is not None and complete(self.round_state, self.rules, self.strategy.threshold, senders)

    def train_of(self, agent: str) -> TrainSettings:
        """The settings ``agent`` was asked to train with in the open round."""
        rs = self.round_state
        assert rs is not None
        return TrainSettings.from_dict(rs.agent_train.get(agent, rs.train))

    def accept(self, completed: Completed, now: float | None = None) -> UpdateRecord:
        """Accept one update into the open round and checkpoint it; ``now`` (default: the time) times the
        agent's pace. A refused update of a selected agent (``UpdateRejected``, re-raised) marks the agent
        failed for the round, so it is not waited for."""
        agent = completed.manifest.sender
        assignment = self.assignments.get(agent) if self.round_state and agent in self.round_state.selected else None
        try:
            record = accept_update(
                completed,
                self.round_state,
                self.late.inputs(agent, completed.manifest.round, self._vector_of(assignment), codec=self.codec,
                                 base_sha256="" if assignment is None else assignment.model.sha256),  # fmt: skip
                policy=self.policy,
                strategy=self.strategy,
                store=self.state.store.updates,
            )
        except NotForThisRound:
            raise
        except UpdateRejected:
            rs = self.round_state
            assert rs is not None  # the gates passed, so a round is open
            # once: a flood of junk costs no write per update; a late one's refusal says nothing of this round
            if completed.manifest.round == rs.round and completed.manifest.sender not in rs.failed:
                rs.failed.append(completed.manifest.sender)
                self.state.checkpoint()
            raise
        if record.late_from:  # folded into this round (``flcore.late``): its pace is not this round's
            log.info("late update folded round=%d agent=%s from_round=%d weight=%g", self.round_state.round,
                     record.agent, record.late_from, record.discount)  # fmt: skip
            self.state.checkpoint()
            return record
        if record.agent in self.round_state.failed:  # it sent a valid update after a refused one
            self.round_state.failed.remove(record.agent)
        self.health.delivered(record.agent)
        self.state.pace.observe(record.agent, (time.time() if now is None else now) - self.round_state.started_at,
                                work_share(self.train_of(record.agent)))  # fmt: skip
        self.state.checkpoint()
        if not self.state.writing_once:  # else once the batch is written (``broker_server.agents.intake``)
            self.on_accepted(record.agent)
        return record

    def on_accepted(self, agent: str) -> None:
        """What the close would do with ``agent``'s update, done now while slower agents train: score its trained
        model if the round's sample holds it (``personal.StartScores.early``) and keep its model for a
        model-keeping strategy (``keep_step``). After the checkpoint, and a failure only logged, since the close
        does whatever is missing."""
        rs = self.round_state
        assert rs is not None
        try:
            self.start_scores.early(rs.round, rs.selected, agent, self._trained_model, self._trained_limit())
        except Exception as exc:  # noqa: BLE001 - an evaluation's failure must not undo an accepted update
            log.warning("trained model not scored on acceptance round=%d agent=%s reason=%s", rs.round, agent, exc)
        try:
            if self.keeper is not None:
                self.keeper.keep_accepted(rs, agent, self.state.store.updates.delta(rs.round, agent),
                                          self.global_arrays, self.global_vector, self.float_spec)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the close keeps it instead
            log.warning("model not kept on acceptance round=%d agent=%s reason=%s", rs.round, agent, exc)

    def reject(self, agent: str, reason: str) -> None:
        """Record a refusal in the open round's metrics (or the next round's, outside a round), as
        ``worth_listing`` allows."""
        target = self.round_state.rejected if self.round_state is not None else self.orphan_rejections
        entry = Rejection(agent=agent, reason=reason).to_dict()
        own = [e["reason"] for e in target if e["agent"] == agent]
        kind = reason_kind(reason)
        if kind in WASTED:  # a trained update lost (metrics.wasted), each agent once a round
            wasted = (self.round_state.wasted if self.round_state is not None else self.orphan_wasted).setdefault(
                kind, [])  # fmt: skip
            if agent not in wasted:
                wasted.append(agent)
        if worth_listing(reason, own, len(target)):
            target.append(entry)

    def close(self, now: float, *, model_wire_bytes: int, stuck: bool = False) -> RoundMetrics:
        """Run the pipeline; commit the new model or roll the round back. Returns the round's metrics.

        ``model_wire_bytes`` is the size of the published model the selected agents downloaded. A ``stuck``
        round (no quorum, nobody left to ask) is rolled back without a pipeline, and the model before the one
        in force comes back when the round says that one is broken (``broker_server.rounds.fallback``)."""
        rs = self.round_state
        assert rs is not None
        if rs.action == "local":  # nothing was uploaded: nothing to aggregate (``broker_server.rounds.local_rounds``)
            return self.local.close(now, model_wire_bytes)
        trained_from = self.version  # the version this round's late updates will have been trained from
        if now >= rs.deadline and not self.rules.is_async:  # closed on the quorum at the deadline: whoever it
            # still waited for missed it (an asynchronous round's go on training into the next buffer)
            late = rs.waited_for
            self.health.back_off(late, rs.round, "missed the deadline", now)
            rs.missed.extend(a for a in late if a not in rs.missed)  # and the round's metrics say so
        ctx = RoundContext(
            state=rs,
            global_arrays=self.global_arrays,
            global_vector=self.global_vector,
            float_spec=self.float_spec,
            open_delta=lambda agent: self.state.store.updates.delta(rs.round, agent),
        )
        outcome, reason, offenders = "committed", "", []
        global_starts = self.local.global_downloads()
        starts = {u.agent: self._start_key(u.agent) for u in rs.on_time}  # before the assignments move on
        personal = self.start_scores.personal(rs.round, rs.on_time, starts, self.start_model,
                                              self.config.server.score_start)  # fmt: skip
        if trained := self.start_scores.trained(rs.round, rs.on_time, self._trained_model, self._trained_limit()):
            personal = {**personal, "trained": trained}
        try:
            if stuck:
                raise RoundRejected(*stuck_reason(rs, self.rules.quorum))
            run_pipeline(self.steps, ctx)
        except RoundRejected as rejected:
            outcome, reason, offenders = "rolled-back", rejected.reason, rejected.offenders
            log.error("round rolled back round=%d reason=%s offenders=%s", rs.round, reason, ",".join(offenders))
        committed = outcome == "committed"
        published = committed and ctx.plan.publish
        if committed:
            assert ctx.candidate is not None and ctx.result is not None
            self.strategy.on_commit(ctx.result)
            if published:
                self.state.fallback = Fallback(self.version, self.model_eval)
                self.state.set_model(ctx.candidate)
                self.state.version += 1
                self.state.model_eval = ctx.evaluation
                self.changes.note(ctx.step_detail.get("change_norm", math.nan))
        elif stuck and broken_model(rs) and (came_from := self.state.fall_back()) is not None:
            reason = f"{reason}; the model in force was broken: back to version {came_from} as {self.version}"
            log.error("model in force broken round=%d back_to_version=%d as_version=%d", rs.round, came_from,
                      self.version)  # fmt: skip
        if self.strategy.keeps_models:
            kept, planned = (ctx.kept, ctx.plan.starts) if committed else ({}, {})
            self.state.assignments = settle(self.assignments, rs.selected, kept, planned)
        agent_of = {u.key: u.agent for u in rs.updates}  # a late update is keyed agent@round
        charged = list(ctx.released) or [agent_of.get(c.agent, c.agent) for c in ctx.contributions]  # swap rounds:
        # whose model left, noised
        averaged = [*charged, *rs.failed] if ctx.result is not None else []
        self.ledger.after_round(averaged, published=published, next_clip=ctx.next_clip)
        bytes_down = model_wire_bytes * global_starts + rs.inbox_bytes
        metrics = round_metrics(ctx, strategy=self.strategy.name, models=self.strategy.models, now=now,
                                outcome=(outcome, reason, offenders), version=self.version, run_id=self.run_id,
                                bytes_down=bytes_down,
                                personal=personal, buffer=buffer_metrics(rs, self.rules) if self.rules.is_async
                                else None)  # fmt: skip
        if published and ctx.evaluation:  # the next round's agents start from this model: evaluated already
            self.start_scores.known(f"{GLOBAL}-v{self.version}", ctx.evaluation)
        if self.config.privacy.enabled:
            metrics = self.ledger.public_metrics(metrics, ctx.noise_std)
        if published and self.strategy.elect_best:
            self.best.note(self.version, rs.round, ctx.evaluation, self.global_arrays)
        self.state.round_state, self.state.next_round = None, rs.round + 1
        done = set(rs.accepted) | set(rs.failed) | set(rs.revoked) | {POOL}
        owed = tuple(a for a in rs.selected if a not in done)
        self.late.after_close(LateWindow(rs.round, trained_from, owed, rs.asked_at or rs.started_at), rs.folded_late)
        self.state.checkpoint(last_metrics=json.loads(metrics.to_json()))  # the commit: what follows is derived from it
        self.state.outputs_pending.update(("metrics", "model") if published else ("metrics",))
        with suppress(DiskError):  # tried again on the daemon's next ticks
            self.state.flush_outputs()
        if self.finished and self.strategy.elect_best:
            with suppress(DiskError), self.state.durably("the best model's election"):  # else elected at the next start
                self._elect_best()
        return metrics

    def _in_force_eval(self) -> dict:
        """The model in force's evaluation: as published, or as this round's start scores have it (the initial one)."""
        return self.model_eval or self.start_scores.of(f"{GLOBAL}-v{self.version}")

    def _start_key(self, agent: str) -> str:
        """Names the model ``agent`` starts this round from: the global model's version, or its assignment's."""
        assignment = self.assignments.get(agent)
        return f"{GLOBAL}-v{self.version}" if assignment is None else assignment.model.sha256

    def _elect_best(self) -> None:
        """The run ended: the best-evaluated version becomes the final global model (``EngineState.elect_best``),
        exported to ONNX as a published one is."""
        exports = [s for s in self.steps if isinstance(s, ExportOnnx)]
        self.state.elect_best(lambda arrays: exports[0].export(arrays, "elected") if exports else None)

    def _end_for_budget(self, affordable: int) -> None:
        """Fewer than ``rounds.min_agents`` agents can afford another round: the run ends here."""
        if not self.budget_exhausted:
            self.budget_exhausted = True
            log.warning("privacy budget exhausted: only %d agents can afford another round within epsilon %g "
                        "(rounds.min_agents = %d); stopping with the last model", affordable,
                        self.config.privacy.target_epsilon, self.rules.min_agents)  # fmt: skip
            if self.strategy.elect_best and not self.best.elected:
                self._elect_best()
