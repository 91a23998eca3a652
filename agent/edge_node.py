"""The one shell every device-side participant runs in (docs/architecture.md, "Edge node").

A role (``agent.daemon.EdgeAgent``: a client of a server, or a region's participant in its root;
``agent.peer.node.PeerNode``: a peer) says what to subscribe to, what to do with a message and on a tick,
what its signed status and last will say and how it stands. The ``EdgeNode`` does the rest, the same for
every role: the one MQTT connection and loop (``protocol.daemon.MqttDaemon``), the device gate
(``agent.telemetry``: its serial readers start and stop with the loop), the connection's session (each
connection gets its own signed last will, whose time every status of that connection names), publishing the
role's signed retained status and checking that it comes back (``agent.echo``: a broker that drops what
this device publishes is reported), the clock against a time authority's signed times (``agent.clock``;
fed by roles that hear one), the Prometheus endpoint (``agent.prometheus``, fed from the role's standing
after every tick) and throttled warnings.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import paho.mqtt.client as paho

from agent.clock import ClockSkew
from agent.config import AgentConfig
from agent.echo import PublishEcho, dropped_text
from agent.prometheus import AgentMetrics
from agent.standing import Standing
from agent.telemetry import Telemetry
from common.logs import Throttle
from protocol.daemon import FINAL_STATUS_WAIT_S, MqttDaemon
from protocol.mqtt import MqttClient, Will
from protocol.topics import Topics
from security.keys import Identity
from security.signing import signed_payload

STATUS_HOLD_S = 5.0  # how long a new connection's statuses wait for an older one paho re-sends (a round trip, normally)


class EdgeRole(Protocol):
    """What a role gives the shell; everything else it asks of ``EdgeNode``."""

    status_topic: str  # its signed retained status (the last will goes there too); its subscriptions cover it

    def subscriptions(self) -> list[str]: ...

    def handle(self, topic: str, payload: bytes) -> None: ...

    def tick(self) -> None: ...

    def started(self) -> None:
        """Its start line (the gate's readers run by now)."""

    def connected(self) -> None:
        """A new connection (its new session is ``EdgeNode.session``): say again where it stands."""

    def offline(self, session: float) -> dict:
        """The unsigned body of its last will for the connection of ``session``."""

    def final_status(self) -> paho.MQTTMessageInfo | None:
        """A clean stop: end its work and publish what it leaves behind (``EdgeNode.publish_status``)."""

    def describe(self) -> str: ...

    def progress_fields(self) -> str: ...

    def finished(self) -> bool: ...

    def standing(self) -> Standing: ...


class EdgeNode(MqttDaemon):
    def __init__(self, config: AgentConfig, identity: Identity, role: EdgeRole, log: logging.Logger) -> None:
        """Built by the role once its own parts stand (the Prometheus endpoint listens from here until ``on_stop``)."""
        self.config = config
        self.id = config.agent.id
        self.topics = Topics(config.agent.federation)
        self.identity = identity
        self.role = role
        self.telemetry = Telemetry(config.telemetry, config.gate, agent=self.id)  # the device gate; readers start later
        self.clock = ClockSkew()
        self.echo = PublishEcho()  # its own status coming back: the broker does not drop what it sends
        self.session = self._next_session = 0.0  # the connection's last will, by time (broker_server.agents.registry)
        self._last: tuple[paho.MQTTMessageInfo, int] | None = None  # the newest status handed to paho, and on which
        # connection (``MqttClient.connections``)
        self._held = False  # a status was held back (``_behind``): the role says again where it stands once free
        self._stopping = False  # the final status goes out whatever is behind
        self._warnings = Throttle(10.0)
        super().__init__(MqttClient(self.id, config.broker, will=self._next_will, on_connect=self._on_connect), log)
        self.metrics = AgentMetrics(config.metrics)  # last: a port that cannot be bound fails the start

    # MqttDaemon --------------------------------------------------------------------------------------
    def subscriptions(self) -> list[str]:
        return self.role.subscriptions()

    def on_start(self) -> None:
        self.telemetry.start()
        self.role.started()

    def handle(self, topic: str, payload: bytes) -> None:
        if topic == self.role.status_topic and self.echo.came_back(payload):
            self.log.info("the broker delivers this device's messages again")
            self.mqtt.report_problem(None)
        self.role.handle(topic, payload)

    def tick(self) -> None:
        if self._held and not self._behind():
            self._held = False
            self.role.connected()  # what was held back goes out now, newer than what paho re-sent
        self.role.tick()
        self.metrics.observe(self.role.standing())
        if self.echo.overdue(self.mqtt.connected.is_set()):
            self.mqtt.report_problem(dropped_text(self.id, self.echo.timeout_s))  # its log line and systemd status

    def publish_final_status(self) -> paho.MQTTMessageInfo | None:
        """The role's last status is never held back: an older one paho re-sends gets a moment to go first."""
        try:
            if self.mqtt.connected.is_set() and self._behind():
                MqttClient.wait_published([self._last[0]], FINAL_STATUS_WAIT_S)
            self._stopping = True
            return self.role.final_status()
        finally:
            self.telemetry.stop()

    def on_stop(self) -> None:
        self.metrics.close()

    def systemd_status(self) -> str:
        return self.role.describe()

    def progress_fields(self) -> str:
        return self.role.progress_fields()

    def finished(self) -> bool:
        return self.role.finished()

    # what roles use ----------------------------------------------------------------------------------
    def publish_status(self, body: dict) -> paho.MQTTMessageInfo | None:
        """The role's signed, retained status; it must come back (``agent.echo``). None, held back, while an older
        one waits to be re-sent (``_behind``)."""
        if self._behind():
            self._held = True
            return None
        payload = signed_payload(body, self.identity)
        self.echo.sent(payload)
        connection = self.mqtt.connections  # before: a reconnect in between must not make a queued one look sent
        self._last = (self.mqtt.publish(self.role.status_topic, payload, retain=True), connection)
        return self._last[0]

    def _behind(self) -> bool:
        """Whether the newest status handed to paho is unacknowledged and went out on a connection that is gone:
        paho re-sends it once connected again, after the new connection's ``on_connect`` and from the moment its
        socket is up a newer status would go out first. The broker would then retain the older one, and the server
        refuse it as older. Held for at most ``STATUS_HOLD_S`` of the new connection. While it is, the loop is to be
        woken by its acknowledgement."""
        if self._stopping or self._last is None or self.mqtt.all_acknowledged([self._last[0]]):
            return False
        info, connection = self._last
        if self.mqtt.connected.is_set() and self.mqtt.connections == connection:
            return False  # in flight on this connection: the next follows it in order
        if self.mqtt.connected.is_set() and time.monotonic() - self.mqtt.connected_since >= STATUS_HOLD_S:
            return False
        self.mqtt.wake_when_acknowledged(info)  # the loop says where it stands as soon as it is through
        return True

    def publish_signed(self, topic: str, body: dict) -> paho.MQTTMessageInfo:
        return self.mqtt.publish(topic, signed_payload(body, self.identity), retain=True)

    def server_time(self) -> float:
        """The time on the time authority's clock, as this device's clock and the measured skew say."""
        return self.clock.server_time(time.time())

    def warn(self, key: str, message: str, *args: object) -> None:
        """A warning, at most one per ``key`` every 10 s; the next says how many were held back."""
        held = self._warnings.allow(key)
        if held is not None:
            self.log.warning(message + (" held_back=%d" if held else ""), *args, *((held,) if held else ()))

    def _next_will(self) -> Will:
        """The signed offline status the broker publishes if the next connection dies: its own session."""
        self._next_session = time.time()
        return Will(self.role.status_topic, signed_payload(self.role.offline(self._next_session), self.identity))

    def _on_connect(self) -> None:
        self.session = self._next_session  # the will this connection was made with (a new one follows)
        self.role.connected()
