"""What ``skyfed monitor`` knows of one federation so far, folded in message by message.

Everything here is as its sender claims it: the monitor holds no keys, so it checks no signature
(``from_signed_json``). Where the server's own status says otherwise (its count of agents online), the
view says so beside the claim (docs/monitoring.md, "skyfed monitor")."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from broker_server.agents.registry import Seen, StatusRefused, refuse_stale
from broker_server.watch import monitor_text as text
from broker_server.watch.history import PastRounds, read_history
from protocol.messages import AgentStatus, MessageError, RoundMetrics, ServerStatus
from protocol.peer_messages import Adoption, PeerBest, PeerMember, PeerRoundMetrics, older
from protocol.topics import Topics

ROUNDS_KEPT = 10  # rounds shown: the last of the metrics since the monitor started, and before them the history's
STALE_WILL = "a replayed 'offline' of an earlier connection ignored, as the server does"
STALE_STATUS = "a replayed older status ignored, as the server does"
STALE_LEFT = "a replayed 'left' of an earlier connection ignored, as peers do"
STALE_MEMBER = "a replayed older membership ignored, as peers do"


@dataclass
class PeerState:
    """One peer's retained ``member``, ``metrics`` and ``best`` (docs/architecture.md, "Peer mode")."""

    member: PeerMember | None = None
    metrics: PeerRoundMetrics | None = None
    best: PeerBest | None = None
    note: str = ""  # why its row is not simply its last membership document

    @property
    def counted(self) -> bool:
        """Peers count a best claim only of a current member, made in its current membership (agent.peer.election)."""
        m, b = self.member, self.best
        return m is not None and b is not None and m.state == "member" and m.gate.ok and m.session == b.session

    @property
    def decision(self) -> Adoption | None:
        """The model this peer says it adopted at the end of its run: of its current (or last) membership only,
        so a decision retained from an earlier run does not count; a peer that left after deciding still does."""
        m, b = self.member, self.best
        return b.adopted if m is not None and b is not None and b.adopted.sha256 and m.session == b.session else None


@dataclass(frozen=True)
class Elected:
    """The model most peers say they adopted (``owner``'s, ``sha256``): ``adopters`` of the ``decided`` peers."""

    owner: str
    sha256: str
    adopters: int
    decided: int


def elected(peers: dict[str, PeerState]) -> Elected | None:
    """Each peer's decision is its own claim (a rogue peer may lie about it), so the surfaces count agreement:
    the (owner, model) most peers adopted, ties to the smaller owner id; None before any peer decided."""
    votes = Counter((d.owner, d.sha256) for s in peers.values() if (d := s.decision) is not None)
    if not votes:
        return None
    (owner, sha256), count = min(votes.items(), key=lambda vote: (-vote[1], vote[0]))
    return Elected(owner, sha256, count, sum(votes.values()))


@dataclass
class FederationView:
    """A federation with a server (server, agents or regions, rounds) or of peers; ``apply`` folds in one message."""

    topics: Topics
    server: ServerStatus | None = None
    metrics: list[RoundMetrics] = field(default_factory=list)
    peers: dict[str, PeerState] = field(default_factory=dict)
    seen: dict[str, Seen] = field(default_factory=dict)  # each agent's status as the server's registry keeps it
    notes: dict[str, str] = field(default_factory=dict)  # per agent: why its row is not simply its last claim
    past: PastRounds = field(default_factory=PastRounds)  # the retained ``server/history``: rounds before these
    shown_round: int = 0  # the newest round shown as a plain line, live or from the history
    run_id: str = ""  # the server run of the rounds shown ("": its server does not say)

    @property
    def agents(self) -> dict[str, AgentStatus]:
        return {agent: seen.status for agent, seen in self.seen.items()}

    @property
    def empty(self) -> bool:
        return self.server is None and not self.agents and not self.metrics and not self.peers

    @property
    def subscriptions(self) -> tuple[str, ...]:
        t = self.topics
        return (t.server_status, t.server_metrics, t.server_history, t.agent_status_wildcard,
                *(t.peer_wildcard(leaf) for leaf in ("member", "metrics", "best")))  # fmt: skip

    def apply(self, topic: str, payload: bytes) -> str | None:
        """Fold in one message; return it as plain lines (for a pipe or a log: one per round of a history, the
        rounds not shown yet), or None if ignored."""
        if not payload:
            return None  # a retained message cleared
        try:
            if topic == self.topics.server_status:
                status = ServerStatus.from_json(payload)
                if status.federation != self.topics.federation:
                    return None  # another federation's server status (a region's, say): not this one's server
                self.server = status
                return text.server_line(status)
            if topic == self.topics.server_metrics:
                metrics = RoundMetrics.from_json(payload)
                self._note_run(metrics.run_id)
                self.metrics = [*self.metrics[1 - ROUNDS_KEPT :], metrics]
                self.shown_round = max(self.shown_round, metrics.round)
                return text.metrics_line(metrics)
            if topic == self.topics.server_history:
                self.past = read_history(payload)
                self._note_run(self.past.run_id)
                new = [row for row in self.past.rows if row["round"] > self.shown_round]
                self.shown_round = max([self.shown_round, *(row["round"] for row in new)])
                return "\n".join(text.history_line(row) for row in new) or None
            if (agent := self.topics.agent_of(topic)) and topic == self.topics.agent_status(agent):
                return self._agent(agent, AgentStatus.from_signed_json(payload))
            if (peer := self.topics.peer_of(topic)) is not None:
                return self._peer(*peer, payload)
        except MessageError:
            pass
        return None

    def _note_run(self, run_id: str) -> None:
        """Rounds of another server run than those shown (a server started over under this federation's name, its
        rounds counted from 1 again): the last run's rounds leave the table, and the new run's are shown from its
        first. A server that names no run (older ones) leaves the rounds as they are."""
        if run_id and run_id != self.run_id:
            if self.run_id:
                self.metrics, self.shown_round = [], 0
                if self.past.run_id != run_id:
                    self.past = PastRounds()
            self.run_id = run_id

    def _agent(self, agent: str, status: AgentStatus) -> str | None:
        """What the server's registry makes of a status, judged alike (broker_server.agents.registry): one signed for
        another agent is not this agent's; a replay (an earlier connection's ``offline``, a status not newer than
        one shown) leaves the row with the newer claim, saying why."""
        if status.agent != agent:
            return None  # the server refuses it: status-mismatch
        before = self.seen.get(agent)
        if before is None:
            self.seen[agent] = Seen(status, 0.0, status.updated_at, status.session)
        elif status != before.status:  # the same one twice (retained, then live) changes nothing
            try:
                refuse_stale(agent, status, before)
            except StatusRefused:
                self.notes[agent] = STALE_WILL if status.state == "offline" else STALE_STATUS
                return text.agent_line(agent, status, self.notes[agent])
            newest = before.newest if status.state == "offline" else status.updated_at
            self.seen[agent] = Seen(status, 0.0, newest, max(before.session, status.session))
        self.notes.pop(agent, None)
        return text.agent_line(agent, status, "")

    def _peer(self, peer: str, leaf: str, payload: bytes) -> str | None:
        """A peer's message counts only under its own name and federation (peers refuse it otherwise:
        ``peer-mismatch``, ``wrong-federation``); a membership older than the one shown is a replay."""
        kind = {"member": PeerMember, "metrics": PeerRoundMetrics, "best": PeerBest}.get(leaf)
        if kind is None:
            return None
        message = kind.from_signed_json(payload)
        if message.peer != peer or getattr(message, "federation", self.topics.federation) != self.topics.federation:
            return None
        state = self.peers.setdefault(peer, PeerState())
        if isinstance(message, PeerMember):
            if state.member is not None and older(message, state.member):
                state.note = STALE_LEFT if message.state == "left" else STALE_MEMBER
                return text.peer_member_line(message, state.note)
            state.member, state.note = message, ""
            return text.peer_member_line(message)
        if isinstance(message, PeerRoundMetrics):
            state.metrics = message
            return text.peer_metrics_line(message)
        state.best = message
        return text.peer_best_line(message)
