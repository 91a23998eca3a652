"""MQTT topic names of one federation (docs/architecture.md, "MQTT topics").

Every topic lives under ``skyfed/<federation>/``. The agent id is also the MQTT client id and the TLS
certificate CN, so a broker ACL can confine each agent to ``agent/<id>/``. This module only builds and
parses names; it never touches a socket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "skyfed"
_LEVEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_level(kind: str, value: str) -> str:
    """Return ``value`` if it is safe as one topic level (no ``/``, ``+``, ``#``), else raise."""
    if not _LEVEL.match(value):
        raise ValueError(
            f"{kind} {value!r} is not a valid name: use 1-64 characters from A-Z a-z 0-9 _ . - "
            "starting with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class Topics:
    """Topic names for one federation."""

    federation: str

    def __post_init__(self) -> None:
        check_level("federation", self.federation)

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.federation}"

    @property
    def server_status(self) -> str:
        return f"{self.prefix}/server/status"

    @property
    def server_metrics(self) -> str:
        return f"{self.prefix}/server/metrics"

    @property
    def server_history(self) -> str:
        """Retained: the last rounds' headline metrics (broker_server.watch.history), for a dashboard opened late."""
        return f"{self.prefix}/server/history"

    @property
    def round(self) -> str:
        return f"{self.prefix}/round"

    def model_chunk(self, version: int, index: int) -> str:
        return f"{self.prefix}/model/{version}/{index}"

    @property
    def model_wildcard(self) -> str:
        return f"{self.prefix}/model/+/+"

    def agent_status(self, agent_id: str) -> str:
        return f"{self.prefix}/agent/{agent_id}/status"

    @property
    def agent_status_wildcard(self) -> str:
        return f"{self.prefix}/agent/+/status"

    def agent_update(self, agent_id: str) -> str:
        return f"{self.prefix}/agent/{agent_id}/update"

    @property
    def agent_update_wildcard(self) -> str:
        return f"{self.prefix}/agent/+/update"

    def agent_inbox(self, agent_id: str) -> str:
        return f"{self.prefix}/agent/{agent_id}/inbox"

    def agent_of(self, topic: str) -> str | None:
        """The agent id in ``…/agent/<id>/…``, or None for any other topic of this federation."""
        parts = topic.split("/")
        if len(parts) == 5 and parts[:3] == [ROOT, self.federation, "agent"]:
            return parts[3]
        return None

    @property
    def any_federation_status_wildcard(self) -> str:
        """Agent status in every federation: the server's way to spot one of its agents configured for another."""
        return f"{ROOT}/+/agent/+/status"

    def foreign_status_of(self, topic: str) -> tuple[str, str] | None:
        """``(federation, agent)`` of an agent status topic of *another* federation, or None."""
        parts = topic.split("/")
        if len(parts) == 5 and parts[0] == ROOT and parts[2] == "agent" and parts[4] == "status":
            return (parts[1], parts[3]) if parts[1] != self.federation else None
        return None

    def model_version_of(self, topic: str) -> int | None:
        """The version in ``…/model/<version>/<index>``, or None."""
        parts = topic.split("/")
        if len(parts) == 5 and parts[:3] == [ROOT, self.federation, "model"] and parts[3].isdigit():
            return int(parts[3])
        return None

    # peer mode (agent.peer): every peer writes only under its own ``peer/<id>/`` ------------------------
    def peer_member(self, peer: str) -> str:
        return f"{self.prefix}/peer/{peer}/member"

    def peer_best(self, peer: str) -> str:
        return f"{self.prefix}/peer/{peer}/best"

    def peer_metrics(self, peer: str) -> str:
        return f"{self.prefix}/peer/{peer}/metrics"

    def peer_to(self, sender: str, recipient: str) -> str:
        return f"{self.prefix}/peer/{sender}/to/{recipient}"

    def peer_wildcard(self, leaf: str) -> str:
        """``peer/+/<leaf>``: every peer's ``member``, ``best``, ``metrics``, or ``to/<recipient>``."""
        return f"{self.prefix}/peer/+/{leaf}"

    def peer_of(self, topic: str) -> tuple[str, str] | None:
        """``(peer, leaf)`` of ``…/peer/<peer>/<leaf>`` (leaf ``to/<recipient>`` for sealed chunks), or None."""
        parts = topic.split("/")
        if len(parts) >= 5 and parts[:3] == [ROOT, self.federation, "peer"]:
            return parts[3], "/".join(parts[4:])
        return None
