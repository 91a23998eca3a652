"""Sending one sealed document to one recipient over MQTT without blocking, until the broker acknowledged
every chunk: an edge agent's update to the server, a peer's model to another peer.

The chunks are handed to paho at once (QoS 1). While the link is down paho holds them and re-sends them
when it reconnects, so the acknowledgement timer runs only while connected and the same data is never
handed over twice by one process. An upload whose link broke after the broker acknowledged some chunks
is marked ``broken``: those chunks may have died with a broker that went away, so its sender may be
asked for it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import paho.mqtt.client as paho

from protocol.mqtt import MqttClient
from security.envelope import seal
from security.keys import Identity, PublicIdentity

PUBLISH_TIMEOUT_S = 120.0


@dataclass
class Upload:
    """Sealed chunks handed to paho, until the broker acknowledged every one."""

    round: int
    attempt: int
    infos: list[paho.MQTTMessageInfo]
    size: int
    started: float
    broken: bool = False  # the link broke after the broker acknowledged some chunks (which it may have lost)

    def check(self, mqtt: MqttClient) -> str:
        """``acknowledged``, ``timed-out`` (connected for ``PUBLISH_TIMEOUT_S`` without every acknowledgement:
        paho keeps re-sending, the caller stops waiting) or ``waiting``."""
        if mqtt.all_acknowledged(self.infos):
            return "acknowledged"
        if not mqtt.connected.is_set():
            self.started = time.monotonic()  # offline: paho holds the chunks; the timer counts connected time
            self.broken = self.broken or any(mqtt.all_acknowledged([info]) for info in self.infos)
            return "waiting"
        return "timed-out" if time.monotonic() - self.started > PUBLISH_TIMEOUT_S else "waiting"


def send_sealed(
    mqtt: MqttClient,
    topic: str,
    data: bytes,
    *,
    sender: Identity,
    recipient: PublicIdentity,
    federation: str,
    kind: str,
    round: int,
    attempt: int = 0,
    now: float | None = None,
) -> Upload:
    """Seal ``data`` to ``recipient`` (``security.envelope``) and hand its chunks to paho on ``topic``. ``now``:
    the time it is signed at, on the recipient's clock (an edge agent's, corrected by ``agent.clock``)."""
    _, chunks = seal(data, sender=sender, federation=federation, kind=kind, round=round, recipient=recipient,
                     now=now)  # fmt: skip
    infos = mqtt.publish_all((topic, chunk) for chunk in chunks)
    return Upload(round, attempt, infos, sum(map(len, chunks)), time.monotonic())
