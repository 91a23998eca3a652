"""Which start model a peer's update may name (docs/architecture.md, "Peer mode", stale-base).

A peer's update names the model it trained from by fingerprint (``flcore.update``). When the peers wait for
all, every one starts round r from the same model m_r; after rounds closed below the threshold their m_r
differ, and a receiver cannot know the sender's. So an update is refused ``stale-base`` when what it names or
holds is provably old, and only then:

* its base is a model this receiver held at the start of an earlier round and holds no more (every peer starts
  round 1 from the same seeded model: an update built on it later is built on an old model);
* its base is one the same sender already named in an earlier round: a peer's model changes every round it
  aggregates, so naming the same one again means it kept training an old model;
* its model is, bit for bit, one this receiver saw in an earlier round: an update any peer sent it then, or a
  model it held itself (replaying an old model under a new round number and a fresh or borrowed base name).

A member's late update of round r − 1, folded into round r (``flcore.late``), is judged as of round r − 1: its
base may be the receiver's m_{r−1}, and its model must be one the receiver has not seen.

The receiver's own m_r is always an acceptable base (all the peers may have kept their model after a round
whose aggregate was refused). Beyond this a base is only a claim: an old model with a little noise added,
named as the receiver's m_r, is an ordinary update, and the strategy's bounds answer it (centered clipping
of ``auto`` around the last round's step).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


def content_digest(vector: np.ndarray) -> str:
    """The SHA-256 of a float vector's bytes: which model an update holds, whatever it claims."""
    return hashlib.sha256(np.ascontiguousarray(vector).view(np.uint8)).hexdigest()


@dataclass
class StaleGuard:
    me: str
    round: int = 0
    current: str = ""  # the fingerprint of this peer's model at the start of ``round``
    previous: str = ""  # ... and at the start of the round before
    held: dict[str, int] = field(default_factory=dict)  # fingerprint -> the first round this peer started from it
    named: dict[tuple[str, str], int] = field(default_factory=dict)  # (sender, base) -> the round it named it
    seen: dict[str, tuple[str, int]] = field(default_factory=dict)  # content digest -> (whose, round)

    def start(self, round_number: int, fingerprint: str, digest: str) -> None:
        """This peer starts ``round_number`` from the model ``fingerprint`` (its floats' ``digest``)."""
        if round_number != self.round:
            self.previous = self.current
        self.round, self.current = round_number, fingerprint
        self.held.setdefault(fingerprint, round_number)
        self.seen.setdefault(digest, ("this peer", round_number))

    def refusal(self, sender: str, base: str, digest: str) -> str:
        """Why ``sender``'s update of this round is stale ("" if it is not); the own is never."""
        if sender == self.me:
            return ""
        if base != self.current and base in self.held:
            return f"stale-base: built on the model this peer held in round {self.held[base]}, not round {self.round}'s"
        named = self.named.get((sender, base), self.round)
        if base != self.current and named < self.round:
            return f"stale-base: {sender} named start model {base[:12]} in round {named} already"
        whose, seen = self.seen.get(digest, ("", self.round))
        if seen < self.round:
            return f"stale-base: its model is one {whose} had in round {seen}, replayed"
        return ""

    def late_refusal(self, sender: str, base: str, digest: str) -> str:
        """Why ``sender``'s late update of the round before is stale ("" if it is not): as ``refusal`` would
        have said in that round, and never a model this peer saw already (a replay, or the same update again)."""
        before = self.round - 1
        if base not in (self.current, self.previous) and self.held.get(base, before) < before:
            return f"stale-base: built on the model this peer held in round {self.held[base]}, not round {before}'s"
        named = self.named.get((sender, base), before)
        if base != self.previous and named < before:
            return f"stale-base: {sender} named start model {base[:12]} in round {named} already"
        if digest in self.seen:
            whose, seen = self.seen[digest]
            return f"stale-base: its model is one {whose} had in round {seen}, replayed"
        return ""

    def note(self, sender: str, base: str, digest: str, *, late: bool = False) -> None:
        """``sender``'s update of this round (``late``: of the round before) was accepted."""
        when = self.round - 1 if late else self.round
        self.named.setdefault((sender, base), when)
        self.seen.setdefault(digest, (sender, when))
