"""Publishing the global model: sealed under the group key, retained in ~1 MiB chunks, old version cleared.

Topic ``model/<version>/<index>``; the manifest's ``round`` field carries the version. Clearing the
previous version's retained chunks (empty retained payloads) keeps the broker from holding every
version ever published.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker_server.agents.model_resend import RetainedModel
from models.serialization import dumps
from models.weights import NamedArrays
from protocol.mqtt import MqttClient
from protocol.topics import Topics
from security.envelope import seal
from security.keys import GroupKey, Identity, PublicIdentity


@dataclass(frozen=True)
class PublishedModel:
    version: int
    sha256: str  # of the plaintext (group-sealed manifests carry it); agents check it against the task
    chunks: int
    wire_bytes: int


class ModelPublisher:
    def __init__(self, mqtt: MqttClient, topics: Topics, identity: Identity, group_key: GroupKey, model: str) -> None:
        self.mqtt = mqtt
        self.topics = topics
        self.identity = identity
        self.group_key = group_key
        self.model = model
        self.current: PublishedModel | None = None
        self.retained = RetainedModel()
        self._data = b""  # the current model's plaintext, for sealing it to one agent

    def seal_for(self, recipient: PublicIdentity) -> list[bytearray]:
        """The current model sealed to one agent alone (its inbox): the same plaintext the task names."""
        assert self.current is not None
        _, chunks = seal(self._data, sender=self.identity, federation=self.topics.federation, kind="model",
                         round=self.current.version, recipient=recipient)  # fmt: skip
        return chunks

    def publish(self, version: int, arrays: NamedArrays) -> PublishedModel:
        data = dumps(arrays, metadata={"model": self.model, "version": str(version)})
        manifest, chunks = seal(
            data,
            sender=self.identity,
            federation=self.topics.federation,
            kind="model",
            round=version,
            group_key=self.group_key,
        )
        for index, chunk in enumerate(chunks):
            self.mqtt.publish(self.topics.model_chunk(version, index), chunk, retain=True)
        self._data = data
        self.retained.published(version, chunks)
        previous = self.current
        if previous is not None and previous.version != version:
            for index in range(previous.chunks):
                self.mqtt.publish(self.topics.model_chunk(previous.version, index), b"", retain=True)
        self.current = PublishedModel(version, manifest.sha256.hex(), len(chunks), sum(len(c) for c in chunks))
        return self.current
