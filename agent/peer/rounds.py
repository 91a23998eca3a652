"""A peer's rounds, step by step from its loop (docs/architecture.md, "Peer mode"):

    gathering → (joining →) training → waiting → … → electing → done

*gathering*: for ``join_wait_s`` it reads the retained memberships, then waits until ``threshold`` peers
are members (at most ``round_timeout_s`` more: a federation starts as a server's waits for its agents); if
a member is past round 1 it is a late joiner (*joining*): members seal their current model to it
(``peer-model``) and it starts from the coordinate-wise median of two or more (the one it has once
``round_timeout_s`` passed). Else every peer starts round 1 from the same model (``federation.model``,
seeded by ``federation.seed``).
*training*: its ``participant.round_client.RoundClient`` trains from this peer's model m_r and encodes and
stores the trained model in the update format (``flcore.update.encode_model``), which is checked like any
peer's and sealed to every current member, also to one that appears later in the round; each peer takes its
change from its own model. *waiting*: until it holds
``threshold`` valid updates (capped at the current members, so a peer that left is not waited for, nor one
that sent nothing in a round that timed out, until it sends an update again) or ``round_timeout_s`` passed since its
own was ready; then m_{r+1} = m_r + the strategy's aggregate
(``agent.peer.collect``), scored on its validation split and written as one line of ``metrics.jsonl``. An
update for the next round is held until then; older ones are refused. *electing*: BestAgg
(``agent.peer.bestagg``); the adopted model is ``best_model.safetensors``.
*gated*: the device gate (``[gate]``, ``[telemetry]``, as an edge agent's) closed before or in a round: a
training job is cancelled, the reasons go in its signed membership and the others stop counting it; once the
gate opens it trains the round again, or catches up as a late joiner if the members moved on.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from agent.config import AgentConfig
from agent.peer.bestagg import BestAgg
from agent.peer.collect import RoundCollector, RoundGuards, coordinate_median, model_refusal
from agent.peer.stale import StaleGuard
from flcore.bounds import lower_median
from flcore.late import late_refusal
from flcore.personal import claimed_personal
from flcore.update import UpdateRejected
from flcore.validation import reason_kind
from models.serialization import SerializationError, dumps, loads
from models.weights import NamedArrays, fingerprint
from models.zoo import initial_model
from participant.jobs import JOINING, Cancelled, Runner, Trained
from participant.progress import ProgressStore
from participant.recipes import checked_settings
from participant.round_client import RoundClient
from protocol.messages import AgentStart, RoundTask, TrainSettings, headline
from protocol.peer_messages import PeerBest, PeerRoundMetrics
from protocol.scores import personal_score

if TYPE_CHECKING:
    from agent.peer.link import PeerLink
    from models.evaluators import Evaluator

log = logging.getLogger("skyfed.peer")
GATED = ("gathering", "training", "waiting", "gated")  # the phases a closed gate stops: before and in a round
METRICS_FILE = "metrics.jsonl"


class PeerRounds:
    def __init__(self, node: PeerLink, config: AgentConfig, *, runner: Runner | None, evaluator: Evaluator | None):
        self.node = node
        self.me = config.agent.id
        self.plan = config.federation
        self.state_dir = config.state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.strategy = self.plan.build_strategy()
        self.policy = self.plan.influence_policy()
        if runner is None:
            from agent.runner import ChildRunner

            runner = ChildRunner(config)
        self.client = RoundClient(self.me, runner, ProgressStore(self.state_dir), whole_model=True, log=log,
                                  warn=node.warn)  # it seals its update to each member itself (``_send_own``)
        if evaluator is None:
            from models.evaluators import build_evaluator

            split = config.test_data_path or config.data_path  # a detector's data.yaml names its val split
            evaluator = build_evaluator(self.plan.model, self.plan.num_classes, split, image_size=self.plan.image_size,
                                        work_dir=self.state_dir / "eval")  # fmt: skip
        self.evaluate = evaluator
        self.guards = RoundGuards(evaluator)  # screening, the step bound and the collapse check (``collect``)
        self.model = initial_model(self.plan.model, self.plan.num_classes, self.plan.seed, config.init_weights_path)
        self.phase, self.round, self.done = "gathering", 0, False
        self.gated: list[str] = []  # why the device gate keeps this peer out of the rounds (its membership says it)
        self.since = time.monotonic()  # when the current phase began (gathering: when connected)
        self.connected_at: float | None = None
        self.collector: RoundCollector | None = None
        self.guard = StaleGuard(self.me)  # the models it held and saw, round after round: stale-base
        self.train_s = 0.0
        self.own_update: bytes | None = None
        self.sent_to: set[str] = set()
        self.silent: set[str] = set()  # members that sent nothing in a round that timed out, since: not waited for
        self.bytes_sent = 0
        self.held: dict[str, tuple[int, bytes, int]] = {}  # sender -> (round, update, wire bytes): the next round's
        self.late_weight = self.plan.fold_weight()  # a member's late update of the round before (flcore.late)
        self.counted: set[str] = set()  # whose own update the round before aggregated: no late one of theirs
        self.catchup: dict[str, tuple[int, NamedArrays]] = {}
        self.served: dict[str, int] = {}  # joiner -> the round it was last sent this peer's model
        self.bestagg = BestAgg(node, self.plan, self.state_dir, evaluator)
        (self.state_dir / METRICS_FILE).unlink(missing_ok=True)

    # the loop ----------------------------------------------------------------------------------------
    def step(self, connected: bool) -> None:
        self.client.runner.release_idle()
        now = time.monotonic()
        if self.phase in GATED and self._gate(now):
            return
        if self.phase == "gathering":
            self.client.runner.prepare(JOINING)  # its first round follows: PyTorch's start-up overlaps the wait
            if connected and self.connected_at is None:
                self.connected_at = now
            if self.connected_at is not None and now - self.connected_at >= self.plan.join_wait_s:
                self._join(now, now - self.connected_at)
        elif self.phase == "joining":
            self._check_catch_up(now)
        elif self.phase == "training":
            self._check_training(now)
        elif self.phase == "waiting":
            self._send_own()
            self._check_waiting(now)
        elif self.phase == "electing" and self.bestagg.step(now, self.silent):
            self.model, self.phase, self.done = self.bestagg.model, "done", True

    def announce(self) -> None:
        """(Re)connected: say where this peer stands (while gathering: a member before its first round)."""
        if self.phase != "done":
            self.node.publish_member("joining" if self.phase == "joining" else "member", self.round)

    def describe(self) -> str:
        phase = f"gated ({'; '.join(self.gated)})" if self.phase == "gated" else self.phase
        return f"round {self.round}: {phase}" if self.round else phase

    def close(self) -> None:
        self.client.close("the peer is stopping")

    def drop(self, peer: str, reason: str) -> None:
        """``peer`` was revoked: its update of this round and any it sent ahead no longer count."""
        if self.collector is not None:
            self.collector.drop(peer, reason)
        self.held.pop(peer, None)
        self.catchup.pop(peer, None)
        self.bestagg.drop(peer)

    # joining -----------------------------------------------------------------------------------------
    def _join(self, now: float, waited: float) -> None:
        """Start round 1 once ``threshold`` peers are here (or ``round_timeout_s`` more passed), or catch up."""
        others = self._member_rounds()
        late = bool(others) and lower_median(np.array(list(others.values()))) > 1
        here = len(others) + 1 + len(set(self.node.roster.sitting_out()) - {self.me})  # gated ones: not waited for
        few = here < self.plan.threshold and waited < self.plan.join_wait_s + self.plan.round_timeout_s
        if few and not late:
            return
        if late:
            log.info("joining late: members %s are past round 1; asking for their models", others)
            self.phase, self.since = "joining", now
            self.node.publish_member("joining", 0)
            return
        self._start_round(1, self.model)

    def catch_up(self, joiner: str) -> None:
        """A late joiner announced itself: seal this peer's current model to it, once per round (a ``joining``
        costs its sender a signature, the answer a whole model: a peer re-announcing itself gets no more)."""
        if self.phase not in ("training", "waiting") or self.served.get(joiner) == self.round:
            return
        self.served[joiner] = self.round
        sent = self.node.seal_to(joiner, "peer-model", self.round, dumps(self.model))
        log.info("catch-up model sent peer=%s round=%d bytes=%d", joiner, self.round, sent)

    def _check_catch_up(self, now: float) -> None:
        """Two members' models, or ``round_timeout_s``: start from their median (or its own) at the members' round."""
        waited = now - self.since >= self.plan.round_timeout_s
        if len(self.catchup) < 2 and not waited:
            return
        others = self._member_rounds()
        start_round = min(self.plan.rounds, max(1, int(lower_median(np.array(list(others.values()) or [1])))))
        if not self.catchup:  # members' rounds that nobody backs with a model cannot stall it
            log.warning("joining late: no member sent its model in %.0f s (members: %s); starting round %d from its "
                        "own", now - self.since, others, start_round)  # fmt: skip
            return self._start_round(start_round, self.model)
        start = coordinate_median([m for _, m in self.catchup.values()])
        log.info("caught up from=%s rounds=%s members=%s starting round=%d", ",".join(sorted(self.catchup)),
                 [r for r, _ in self.catchup.values()], others, start_round)  # fmt: skip
        self.catchup.clear()
        return self._start_round(start_round, start)

    def _member_rounds(self) -> dict[str, int]:
        """Each other member's signed round: their lower median, not one member's word, decides joining late."""
        return {p: self.node.roster.members[p].round for p in self.node.members() if p != self.me}

    # a round -----------------------------------------------------------------------------------------
    def _start_round(self, round_number: int, model: NamedArrays) -> None:
        self.round, self.model = round_number, model
        self.collector = RoundCollector(round_number, model, self.policy, self.me, self.guard)
        self.own_update, self.sent_to, self.bytes_sent = None, set(), 0
        if reasons := self.node.edge.telemetry.reasons():
            self._sit_out(reasons)
        else:
            self.node.publish_member("member", round_number)
            self._train()
        held, self.held = self.held, {}
        for sender, (held_round, data, wire) in sorted(held.items()):
            if held_round == round_number:
                self._accept(sender, data, wire)
            else:
                log.warning("update dropped round=%d peer=%s reason=late: now round %d", held_round, sender,
                            round_number)  # fmt: skip

    def _task(self, round_number: int) -> RoundTask:
        """The round as the trainer and ``encode_update`` read it: this peer's own plan, nobody's order."""
        plan = self.plan
        train = TrainSettings(epochs=plan.epochs, batch_size=plan.batch_size, lr=plan.lr, momentum=plan.momentum,
                              image_size=plan.image_size)  # fmt: skip
        train = checked_settings(self.strategy.configure_train(train, round_number, {}).shared)  # its recipes
        return RoundTask(federation=self.node.topics.federation, round=round_number, attempt=0,
                         strategy=self.strategy.name, model=plan.model, num_classes=plan.num_classes,
                         model_version=round_number - 1, model_sha256=fingerprint(self.model), model_chunks=0,
                         group_key_id="", selected=[self.me], pending=[], deadline=0.0, issued_at=time.time(),
                         train=train, run_id=f"peer-{plan.seed}", classes=list(plan.classes))  # fmt: skip

    def _train(self) -> None:
        task = self._task(self.round)
        self.client.train(task, AgentStart(self.me, "peer", task.model_sha256), self.model)
        self.phase, self.since = "training", time.monotonic()

    def _check_training(self, now: float, cancel: str = "") -> None:
        """Its own update once trained (``cancel``: the gate closed; a result that came first still counts)."""
        assert self.collector is not None
        report = self.client.poll(cancel=cancel)
        if report is None:
            return
        self.train_s = now - self.since
        if isinstance(report.outcome, Cancelled):
            log.warning("training stopped round=%d: %s", self.round, report.outcome.reason)
        elif not isinstance(report.outcome, Trained) or report.update is None:
            log.error("training round=%d gave no update: %s", self.round, report.outcome)
        elif self._accept(self.me, report.update, 0):
            self.own_update = report.update
        if not cancel:
            self.phase, self.since = "waiting", now

    # the device gate ---------------------------------------------------------------------------------
    def _gate(self, now: float) -> bool:
        """True while the gate keeps this peer out: a closed gate stops it before or in a round (``_sit_out``);
        when it opens (and a cancelled job has ended) the peer takes part again (``_resume``)."""
        reasons = self.node.edge.telemetry.reasons()
        if reasons and [r.split(":")[0] for r in reasons] != [r.split(":")[0] for r in self.gated]:
            self._sit_out(reasons)  # closed, or closed for other reasons: its membership says so
        if self.phase != "gated":
            return False
        if self.client.training is not None:
            self._check_training(now, cancel=f"gate closed: {'; '.join(self.gated)}")
        elif not reasons:
            self._resume(now)
        return True

    def _sit_out(self, reasons: list[str]) -> None:
        if not self.gated:
            log.info("gate closed round=%d: %s; the other peers do not wait for this one until it opens", self.round,
                     "; ".join(reasons))  # fmt: skip
        self.gated, self.phase = reasons, "gated"
        self.client.runner.release_idle(gate_closed=True)  # a running job is cancelled by ``_gate``
        self.node.publish_member("member", self.round)

    def _resume(self, now: float) -> None:
        """Open again: in the members' round it trains it (or, trained already, waits); behind them it catches up
        as a late joiner does; before round 1 it gathers again."""
        self.gated = []
        others = self._member_rounds()
        behind = self.round >= 1 and bool(others) and lower_median(np.array(list(others.values()))) > self.round
        log.info("gate open round=%d: taking part again%s", self.round, f"; members are at {others}" if behind else "")
        if behind:
            self.phase, self.since, self.collector = "joining", now, None
            self.node.publish_member("joining", self.round)
            return
        self.node.publish_member("member", self.round)
        if self.round == 0:
            self.phase = "gathering"
        elif self.own_update is None:
            self._train()
        else:
            self.phase, self.since = "waiting", now

    def _send_own(self) -> None:
        """To every current member it has not gone to yet (one that joined during the round too)."""
        if self.own_update is None:
            return
        for peer in self.node.members():
            if peer != self.me and peer not in self.sent_to:
                self.sent_to.add(peer)
                self.bytes_sent += self.node.seal_to(peer, "peer-update", self.round, self.own_update)

    def _check_waiting(self, now: float) -> None:
        assert self.collector is not None
        members = set(self.node.members()) | {self.me}
        needed = min(self.plan.threshold, len(members - self.silent))
        timed_out = now - self.since >= self.plan.round_timeout_s
        # current members' updates only: one that sent and left must not close the round before an honest update
        if len(members & set(self.collector.updates)) < needed and not timed_out:
            return
        if timed_out:
            missing = sorted(members - set(self.collector.updates) - {self.me})
            log.warning("round %d timed out after %.0f s with %d of %d updates; not waited for until they send again: "
                        "%s", self.round, self.plan.round_timeout_s, len(self.collector.updates), needed,
                        ",".join(missing) or "-")  # fmt: skip
            self.silent.update(missing)
        self._finish_round(now)

    def _finish_round(self, now: float) -> None:
        collector = self.collector
        assert collector is not None
        outcome, reason, detail, model = "aggregated", "", {}, self.model
        if not collector.updates:
            outcome, reason = "rejected", "no-updates"
        else:
            try:
                model, detail = collector.aggregate(self.strategy, self.guards)
            except UpdateRejected as exc:
                outcome, reason = "rejected", exc.reason
        evaluation = self.guards.evaluation_of(model) or self.evaluate(model)
        line = PeerRoundMetrics(peer=self.me, round=self.round, outcome=outcome, eval=evaluation,
                                aggregated_from=collector.on_time if outcome == "aggregated" else [],
                                rejected=collector.rejected, members=self.node.members(), reason=reason,
                                round_s=round(self.train_s + now - self.since, 3), train_s=round(self.train_s, 3),
                                wait_s=round(now - self.since, 3), bytes_sent=self.bytes_sent,
                                bytes_received=sum(u.record.wire_bytes for u in collector.updates.values()),
                                aggregation=detail, personal=claimed_personal(
                                    [collector.updates[p].record for p in collector.on_time]))  # fmt: skip
        self._write_metrics(line)
        self.counted = set(line.aggregated_from)
        log.info("round %d %s from=%s accuracy=%s trained_c_spe=%s rejected=%d%s", self.round, outcome,
                 ",".join(line.aggregated_from) or "-", headline(evaluation),
                 personal_score(line.personal, "trained_c_spe"), collector.refused,
                 f" reason={reason}" if reason else "")  # fmt: skip
        if self.round >= self.plan.rounds:
            self.model, self.phase = model, "electing"
            return self.bestagg.start(model, self.round, evaluation, now)
        self._start_round(self.round + 1, model)

    def _write_metrics(self, line: PeerRoundMetrics) -> None:
        with open(self.state_dir / METRICS_FILE, "ab") as handle:
            handle.write(line.to_json() + b"\n")
        self.node.publish_metrics(line.to_dict())

    # received ----------------------------------------------------------------------------------------
    def receive_update(self, sender: str, round_number: int, data: memoryview, wire_bytes: int) -> None:
        self.silent.discard(sender)  # alive: a straggler is waited for again (security/README.md, "Peer mode")
        current = self.phase in ("training", "waiting", "gated") and self.collector is not None
        if current and round_number == self.round:
            self._accept(sender, data, wire_bytes)
        elif current and self.late_weight and round_number == self.round - 1 and sender not in self.counted:
            self._accept(sender, data, wire_bytes, late=True)  # folded into this round (flcore.late)
        elif round_number == self.round + 1 or (self.phase in ("gathering", "joining") and round_number >= 1):
            self.held[sender] = (round_number, bytes(data), wire_bytes)  # one per sender: bounded
        elif current and self.late_weight and round_number < self.round - 1:
            self.node.warn(f"round-{sender}", "update refused round=%d peer=%s reason=%s", round_number, sender,
                           late_refusal(round_number, self.round, folding=True, owed=False))  # fmt: skip
        else:
            self.node.warn(f"round-{sender}", "update refused round=%d peer=%s reason=wrong-round: this peer is in "
                           "round %d (%s)", round_number, sender, self.round, self.phase)  # fmt: skip

    def _accept(self, sender: str, data: bytes | memoryview, wire_bytes: int, *, late: bool = False) -> bool:
        assert self.collector is not None
        try:
            update = self.collector.accept(sender, data, wire_bytes, self.late_weight if late else 0.0)
        except UpdateRejected as exc:
            self.node.warn(f"update-{sender}-{reason_kind(exc.reason)}", "update refused round=%d peer=%s reason=%s%s",
                           self.round, sender, exc.reason, " (late)" if late else "")  # fmt: skip
            return False
        log.info("update accepted round=%d peer=%s norm=%.4g weight=%d%s", self.round, sender, update.record.norm,
                 update.record.samples, f" late from round {self.round - 1}" if late else "")  # fmt: skip
        return True

    def receive_model(self, sender: str, round_number: int, data: memoryview) -> None:
        try:
            arrays = {name: a.copy() for name, a in loads(data)[0].items()}
        except SerializationError as exc:
            self.node.warn(f"model-{sender}", "model refused peer=%s reason=malformed: %s", sender, exc)
            return
        refusal = model_refusal(arrays, self.model, round_number, self.plan.rounds + 1)
        if refusal:
            self.node.warn(f"model-{sender}-{reason_kind(refusal)}", "model refused peer=%s reason=%s", sender, refusal)
            if round_number == self.plan.rounds + 1:  # its final model: the election need not wait for it
                self.bestagg.refused_models[sender] = refusal
            return
        if self.phase == "joining":
            self.catchup[sender] = (round_number, arrays)
        elif round_number == self.plan.rounds + 1:
            self.bestagg.final_models[sender] = arrays
        else:
            self.node.warn(f"model-{sender}", "model ignored peer=%s round=%d reason=not-expected", sender,
                           round_number)  # fmt: skip

    def note_claim(self, claim: PeerBest) -> None:
        self.bestagg.note_claim(claim)


def read_metrics(state_dir: Path) -> list[dict]:
    """A peer's ``metrics.jsonl`` lines."""
    path = state_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
