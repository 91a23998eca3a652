"""What peers publish about themselves, each signed with the peer's Ed25519 key (``security.signing``) and
retained under its own ``peer/<id>/`` subtree (the broker ACL lets only that peer write there):
``member`` (its membership; its last will is a signed ``left``), ``best`` (BestAgg's claim, then also its
decision) and ``metrics`` (its last round, for operators). They live in ``protocol/`` because ``skyfed monitor`` reads
them too (docs/architecture.md, "Peer mode")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.messages import Gate, Message

MEMBER_STATES = ("member", "joining", "left")
MAX_ROUND = 2**31  # no federation runs more rounds; a member's claimed round stays a number the others compute with


@dataclass(frozen=True)
class PeerMember(Message):
    """``joining``: a late joiner waiting for members' models; ``member``: it trains ``round`` now;
    ``left``: gone (a clean stop or its last will). ``session`` is its connection's time: a ``left`` of
    an earlier connection replayed does not remove a peer that came back. ``gate``: its device gate (as an
    edge agent's status says it); closed, it sits the rounds out and nobody waits for it."""

    SCHEMA: ClassVar[str] = "skyfed.peer-member/1"
    federation: str
    peer: str
    state: str
    round: int
    session: float
    issued_at: float
    gate: Gate = field(default_factory=Gate)

    def __post_init__(self) -> None:
        if self.state not in MEMBER_STATES:
            raise ValueError(f"state must be one of {', '.join(MEMBER_STATES)}, got {self.state!r}")
        if not 0 <= self.round <= MAX_ROUND:  # JSON has integers of any size; the lower median takes them as floats
            got = self.round if abs(self.round) < 10**12 else f"a {len(str(abs(self.round)))}-digit number"
            raise ValueError(f"round must be in [0, {MAX_ROUND}], got {got}")


def older(member: PeerMember, held: PeerMember) -> bool:
    """A ``left`` (a last will, made when its connection began) counts for its own connection or a later one;
    any other document must also be newer than the one held (peers and ``skyfed monitor`` judge alike)."""
    if member.state == "left":
        return member.session < held.session
    return (member.session, member.issued_at) < (held.session, held.issued_at)


@dataclass(frozen=True)
class Adoption(Message):
    """A peer's election decision: the model it adopted (``sha256``), whose it was (``owner``) and its score on
    the peer's own validation split. Empty (``sha256`` "") until it decided; a peer's own word, so operators
    count how many peers agree rather than trust one."""

    sha256: str = ""
    owner: str = ""
    score: float | None = None  # null where the model scored no finite number there


@dataclass(frozen=True)
class PeerBest(Message):
    """BestAgg: this peer's final model scored on its own validation split. ``session`` is the connection
its membership names: a claim retained from an earlier run does not count in this one. Once it elected, the
peer publishes the same claim again with ``adopted`` filled in (a reader of the older schema ignores it)."""

    SCHEMA: ClassVar[str] = "skyfed.peer-best/1"
    federation: str
    peer: str
    round: int
    score: float
    sha256: str
    session: float
    adopted: Adoption = field(default_factory=Adoption)


@dataclass(frozen=True)
class PeerRoundMetrics(Message):
    """One line of a peer's ``metrics.jsonl``: one round as this peer saw it."""

    SCHEMA: ClassVar[str] = "skyfed.peer-metrics/1"
    peer: str
    round: int
    outcome: str  # "aggregated" | "rejected" (the aggregate was refused: the model stays)
    eval: dict[str, float]
    aggregated_from: list[str]
    rejected: list[dict[str, str]] = field(default_factory=list)
    members: list[str] = field(default_factory=list)
    reason: str = ""
    round_s: float = 0.0
    train_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    aggregation: dict[str, Any] = field(default_factory=dict)
    # the senders' own C-SPE of their start and trained models (``flcore.personal.claimed_personal``)
    personal: dict[str, Any] = field(default_factory=dict)
