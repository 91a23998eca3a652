"""A peer's last phase, *electing* (SmartFed's BestAgg, docs/architecture.md "Peer mode"), driven from its loop:
it publishes its final model's score, waits for every current member's claim (or ``round_timeout_s``), and
adopts the leader's model once its own split scores it within ``best_margin`` (``agent.peer.election``); a
refused or missing leader passes the lead to the next claim, down to its own model. The adopted model is
``best_model.safetensors``, the decision ``election.json``, and the peer publishes its decision too (its
``best`` again, ``adopted`` filled in) for operators' surfaces.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from agent.peer.election import Election
from common.files import atomic_write
from models.serialization import dumps, save_file
from models.weights import NamedArrays, fingerprint
from protocol.messages import headline
from protocol.peer_messages import Adoption, PeerBest

if TYPE_CHECKING:
    from agent.peer.link import PeerLink
    from agent.peer.plan import FederationSection
    from models.evaluators import Evaluator

log = logging.getLogger("skyfed.peer")
BEST_FILE = "best_model.safetensors"


class BestAgg:
    def __init__(self, node: PeerLink, plan: FederationSection, state_dir: Path, evaluate: Evaluator) -> None:
        self.node, self.plan, self.state_dir, self.evaluate = node, plan, state_dir, evaluate
        self.me = node.id
        self.claims: dict[str, PeerBest] = {}  # received before this peer elects too
        self.election: Election | None = None
        self.final_models: dict[str, NamedArrays] = {}
        self.refused_models: dict[str, str] = {}  # a member's final model refused as it came (``model_refusal``): why
        self.leader: PeerBest | None = None  # the election's winning claim, once decided
        self.model: NamedArrays = {}  # this peer's final model, then the adopted one
        self.since = 0.0

    def note_claim(self, claim: PeerBest) -> None:
        self.claims[claim.peer] = claim
        if self.election is not None:
            self.election.note(claim)

    def drop(self, peer: str) -> None:
        """``peer`` was revoked: its claim no longer counts."""
        self.claims.pop(peer, None)
        if self.election is not None:
            self.election.claims.pop(peer, None)

    def start(self, model: NamedArrays, round_number: int, evaluation: dict[str, float], now: float) -> None:
        """Claim ``model``'s score (``evaluation``, on this peer's split)."""
        self.model, self.since = model, now
        score = headline(evaluation)
        own = PeerBest(self.node.topics.federation, self.me, round_number, float(score if score is not None else -1),
                       fingerprint(model), self.node.edge.session)  # fmt: skip
        self.election = Election(self.me, own, self.plan.best_margin, now)
        for claim in self.claims.values():
            self.election.note(claim)
        self.node.publish_best(own)

    def step(self, now: float, silent: set[str]) -> bool:
        """True once a model is adopted (``silent``: members not waited for)."""
        election = self.election
        assert election is not None
        members = self.node.members()
        sessions = {peer: self.node.roster.members[peer].session for peer in members}
        timed_out = now - self.since >= self.plan.round_timeout_s
        if self.leader is None:
            waited_for = {peer: session for peer, session in sessions.items() if peer not in silent}
            if not election.complete(waited_for) and not timed_out and not election.passed:
                return False
            self.leader = election.leader(sessions)
            log.info("best model claims %s leader=%s", {p: c.score for p, c in sorted(election.claims.items())},
                     self.leader.peer)  # fmt: skip
            if self.leader.peer == self.me:
                for peer in members:
                    if peer != self.me:
                        self.node.seal_to(peer, "peer-model", self.plan.rounds + 1, dumps(self.model))
                return self._adopt(self.me, election.own.score)
            self.since = now
            return False
        model = self.final_models.get(self.leader.peer)
        if model is None:
            if refused := self.refused_models.get(self.leader.peer):  # came, and was refused: no need to wait
                self._pass_leader(now, refused)
            elif timed_out:
                self._pass_leader(now, "its model never came")
            return False
        score = headline(self.evaluate(model))
        refusal = election.judge(self.leader, model, self.model, score if score is not None else float("nan"))
        if refusal:
            self._pass_leader(now, refusal)
            return False
        self.model = model
        return self._adopt(self.leader.peer, score)

    def _pass_leader(self, now: float, refusal: str) -> None:
        """The next best claim leads (down to the own): a liar costs one look or ``round_timeout_s``, not the vote."""
        assert self.election is not None and self.leader is not None
        log.warning("best model refused peer=%s claimed=%.4f reason=%s", self.leader.peer, self.leader.score, refusal)
        self.election.passed[self.leader.peer] = refusal
        self.leader, self.since = None, now

    def _adopt(self, owner: str, score: float | None) -> bool:
        """Keep ``owner``'s model (``score`` on this peer's split), write the decision and publish it."""
        assert self.election is not None
        save_file(self.state_dir / BEST_FILE, self.model)
        refused = "; ".join(f"{peer}: {why}" for peer, why in self.election.passed.items())
        score = score if score is not None and math.isfinite(score) else None
        adopted = Adoption(fingerprint(self.model), owner, score)
        record = {"peer": self.me, "adopted_from": owner, "sha256": adopted.sha256, "score": score, "refused": refused}
        atomic_write(self.state_dir / "election.json", json.dumps(record).encode())
        self.node.publish_best(replace(self.election.own, adopted=adopted))
        log.info("best model adopted from=%s%s", owner, f" (refused: {refused})" if refused else "")
        return True
