"""SmartFed's ``BestAgg`` at the end of a run: every peer scores its final model on its own validation split
and publishes the score (``peer/<id>/best``, signed); once every current member has (or the round timeout
passed), the best claim wins (highest score, then the smallest peer id) and its owner seals its model to
every member. A claim is only a claim: before adopting the winner's model a peer scores it on its own
split and refuses it when it is more than ``margin`` worse than its own model there, so a peer lying about
its score gains nothing; the next best claim then leads (this peer's own at worst), so the liar does not
keep the others from the honest best model either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from agent.peer.collect import same_layout
from models.weights import NamedArrays, fingerprint, float_part
from protocol.peer_messages import PeerBest


@dataclass
class Election:
    me: str
    own: PeerBest
    margin: float
    started: float
    claims: dict[str, PeerBest] = field(default_factory=dict)
    passed: dict[str, str] = field(default_factory=dict)  # claimants whose model was refused here, and why

    def __post_init__(self) -> None:
        self.claims[self.me] = self.own

    def note(self, claim: PeerBest) -> None:
        if math.isfinite(claim.score):
            self.claims[claim.peer] = claim

    def counted(self, sessions: dict[str, float]) -> dict[str, PeerBest]:
        """The claims of this peer and of the current members (``sessions``: member → its membership's
        session) made in their current membership."""
        return {peer: c for peer, c in self.claims.items() if peer == self.me or sessions.get(peer) == c.session}

    def complete(self, sessions: dict[str, float]) -> bool:
        """Every current member has claimed."""
        return set(sessions) <= set(self.counted(sessions)) | {self.me}

    def leader(self, sessions: dict[str, float]) -> PeerBest:
        """The best claim counted whose model was not refused here (this peer's own at worst)."""
        left = [c for peer, c in self.counted(sessions).items() if peer not in self.passed]
        return min(left, key=lambda c: (-c.score, c.peer))

    def judge(self, claim: PeerBest, model: NamedArrays, own_model: NamedArrays, score: float) -> str:
        """"" to adopt ``model`` (the winner's, scored ``score`` here), else why it is refused."""
        if fingerprint(model) != claim.sha256:
            return "not-the-claimed-model"
        if not same_layout(model, own_model):
            return "wrong-tensors"
        if not all(np.isfinite(a).all() for a in float_part(model).values()):
            return "non-finite-model"
        if not math.isfinite(score) or score < self.own.score - self.margin:
            return f"worse-here: scored {score:.4f} on this peer's split, its own model {self.own.score:.4f}"
        return ""
