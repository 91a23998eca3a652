"""What ``skyfed monitor`` knows of one federation so far, folded in message by message.

Everything here is as its sender claims it: the monitor holds no keys, so it checks no signature
(``from_signed_json``). Where the server's own status says otherwise (its count of agents online), the
view says so beside the claim (docs/monitoring.md, "skyfed monitor")."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker_server import monitor_text as text
from protocol.messages import AgentStatus, MessageError, RoundMetrics, ServerStatus
from protocol.peer_messages import PeerBest, PeerMember, PeerRoundMetrics
from protocol.topics import Topics

ROUNDS_KEPT = 10  # rounds of metrics shown (metrics are not retained: those since the monitor started)
STALE_WILL = "a replayed 'offline' of an earlier connection ignored, as the server does"


@dataclass
class PeerState:
    """One peer's retained ``member``, ``metrics`` and ``best`` (docs/architecture.md, "Peer mode")."""

    member: PeerMember | None = None
    metrics: PeerRoundMetrics | None = None
    best: PeerBest | None = None


@dataclass
class FederationView:
    """A federation with a server (server, agents or regions, rounds) or of peers; ``apply`` folds in one message."""

    topics: Topics
    server: ServerStatus | None = None
    agents: dict[str, AgentStatus] = field(default_factory=dict)
    metrics: list[RoundMetrics] = field(default_factory=list)
    peers: dict[str, PeerState] = field(default_factory=dict)
    sessions: dict[str, float] = field(default_factory=dict)  # each agent's newest connection, as its statuses claim
    notes: dict[str, str] = field(default_factory=dict)  # per agent: why its row is not simply its last claim

    @property
    def empty(self) -> bool:
        return self.server is None and not self.agents and not self.metrics and not self.peers

    @property
    def subscriptions(self) -> tuple[str, ...]:
        t = self.topics
        return (t.server_status, t.server_metrics, t.agent_status_wildcard,
                *(t.peer_wildcard(leaf) for leaf in ("member", "metrics", "best")))  # fmt: skip

    def apply(self, topic: str, payload: bytes) -> str | None:
        """Fold in one message; return it as one plain line (for a pipe or a log), or None if ignored."""
        if not payload:
            return None  # a retained message cleared
        try:
            if topic == self.topics.server_status:
                self.server = ServerStatus.from_json(payload)
                return text.server_line(self.server)
            if topic == self.topics.server_metrics:
                self.metrics = [*self.metrics[1 - ROUNDS_KEPT :], RoundMetrics.from_json(payload)]
                return text.metrics_line(self.metrics[-1])
            if (agent := self.topics.agent_of(topic)) and topic == self.topics.agent_status(agent):
                return self._agent(agent, AgentStatus.from_signed_json(payload))
            if (peer := self.topics.peer_of(topic)) is not None:
                return self._peer(*peer, payload)
        except MessageError:
            pass
        return None

    def _agent(self, agent: str, status: AgentStatus) -> str:
        """An ``offline`` older than a connection the agent already claimed is a replayed last will: the server
        refuses it (broker_server.registry), so the row keeps the newer claim and says why."""
        newest = self.sessions.get(agent, 0.0)
        if status.state == "offline" and status.updated_at < newest and agent in self.agents:
            self.notes[agent] = STALE_WILL
            return text.agent_line(agent, status, STALE_WILL)
        self.sessions[agent] = max(newest, status.session)
        self.agents[agent] = status
        self.notes.pop(agent, None)
        return text.agent_line(agent, status, "")

    def _peer(self, peer: str, leaf: str, payload: bytes) -> str | None:
        """A peer's message counts only under its own name (peers refuse it otherwise: ``peer-mismatch``)."""
        kind = {"member": PeerMember, "metrics": PeerRoundMetrics, "best": PeerBest}.get(leaf)
        if kind is None:
            return None
        message = kind.from_signed_json(payload)
        if message.peer != peer:
            return None
        state = self.peers.setdefault(peer, PeerState())
        if isinstance(message, PeerMember):
            state.member = message
            return text.peer_member_line(message)
        if isinstance(message, PeerRoundMetrics):
            state.metrics = message
            return text.peer_metrics_line(message)
        state.best = message
        return text.peer_best_line(message)
