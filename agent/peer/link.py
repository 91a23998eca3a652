"""What a peer's round work (``agent.peer.rounds.PeerRounds``, ``agent.peer.bestagg.BestAgg``) asks of its node
(``agent.peer.node.PeerNode``): its name, the members, and publishing and sealing to them. Typed here, below
both, so the round work never imports the node that holds it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import paho.mqtt.client as paho

    from agent.edge_node import EdgeNode
    from agent.peer.roster import Roster
    from protocol.peer_messages import PeerBest
    from protocol.topics import Topics


class PeerLink(Protocol):
    id: str
    topics: Topics
    edge: EdgeNode  # its gate's reasons and its connection's session
    roster: Roster

    def members(self) -> list[str]: ...

    def publish_member(self, state: str, round_number: int) -> paho.MQTTMessageInfo | None: ...

    def publish_best(self, best: PeerBest) -> None: ...

    def publish_metrics(self, body: dict) -> None: ...

    def seal_to(self, peer: str, kind: str, round_number: int, data: bytes) -> int: ...

    def warn(self, key: str, message: str, *args: object) -> None: ...
