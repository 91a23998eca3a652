"""The signed round task, retained on the ``round`` topic: published, and put back when another publisher
(a replayed old task, say) replaced it."""

from __future__ import annotations

import logging
from dataclasses import replace

from protocol.messages import MAX_JSON_BYTES, RoundTask
from protocol.mqtt import MqttClient
from security.keys import Identity
from security.signing import round_receipt, signed_payload

log = logging.getLogger("skyfed.server")

REASSERT_INTERVAL_S = 1.0


class TaskPublisher:
    def __init__(self, mqtt: MqttClient, topic: str, identity: Identity) -> None:
        self.mqtt = mqtt
        self.topic = topic
        self.identity = identity
        self.payload: bytes | None = None  # the current task, as signed and published
        self._reasserted_at = 0.0
        self._reassert_pending = False

    def publish(self, task: RoundTask) -> None:
        receipt = round_receipt(self.identity, task.federation, task.run_id, task.round, task.model_version)
        self.payload = signed_payload(replace(task, receipt=receipt).to_dict(), self.identity)
        if len(self.payload) > MAX_JSON_BYTES:  # agents would refuse it: say why rounds stall
            log.error("round task is %d bytes, over the %d agents accept: select fewer agents per round "
                      "(rounds.fraction)", len(self.payload), MAX_JSON_BYTES)  # fmt: skip
        self.mqtt.publish(self.topic, self.payload, retain=True)

    def received(self, payload: bytes, now: float) -> None:
        """What the broker holds on the topic now: put the current task back if it was replaced (at most once
        a second; a replacement inside that second is undone by ``heal`` after it)."""
        if self.payload is not None and payload != self.payload:
            self._reassert_pending = True
            self.heal(now)

    def heal(self, now: float) -> None:
        if self._reassert_pending and self.payload is not None and now - self._reasserted_at >= REASSERT_INTERVAL_S:
            self._reassert_pending, self._reasserted_at = False, now
            self.mqtt.publish(self.topic, self.payload, retain=True)
            log.warning("the retained round task was replaced by another publisher; re-published the current one")
