"""A thin MQTT client over paho-mqtt 2.x: QoS 1, persistent sessions, LWT, reconnect with back-off, TLS.

Deliberately small (see STYLE.md on paho's own 5,000-line client): it connects, keeps the session,
re-subscribes after every (re)connect, and hands received messages to the caller's thread through a
bounded queue, so decryption, aggregation and training never run on paho's network thread (which must
keep answering keep-alives). Chunking, schemas and round logic live elsewhere. Works with MQTT 3.1.1
and 5: everything SkyFed needs is in the payloads.
"""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

log = logging.getLogger("skyfed.mqtt")

SESSION_EXPIRY_S = 7 * 24 * 3600  # MQTT 5: keep the session (and queued QoS 1 messages) for a week


@dataclass(frozen=True)
class TlsSettings:
    """Client TLS: the CA that signed the broker, and this node's certificate and key (mutual TLS)."""

    ca_certs: str
    certfile: str | None = None
    keyfile: str | None = None


@dataclass(frozen=True)
class BrokerSettings:
    """Where and how to connect. ``protocol`` is ``"3.1.1"`` or ``"5"``."""

    host: str = "127.0.0.1"
    port: int = 1883
    protocol: str = "3.1.1"
    keepalive_s: int = 30
    username: str | None = None
    password: str | None = None
    tls: TlsSettings | None = None
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.protocol not in ("3.1.1", "5"):
            raise ValueError(f'broker.protocol must be "3.1.1" or "5", got {self.protocol!r}')
        if not 0 < self.port < 65536:
            raise ValueError(f"broker.port must be 1-65535, got {self.port}")
        if not 1 <= self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError(
                "broker.reconnect_min_s must be >= 1 and <= broker.reconnect_max_s (whole seconds, paho's unit), "
                f"got {self.reconnect_min_s} and {self.reconnect_max_s}"
            )

    @classmethod
    def from_address(cls, address: str, **kwargs: object) -> BrokerSettings:
        """Parse ``HOST:PORT`` (as given on the command line)."""
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"broker address {address!r} must look like HOST:PORT, e.g. 127.0.0.1:1883")
        return cls(host=host, port=int(port), **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Will:
    """The last-will message the broker publishes if this client vanishes."""

    topic: str
    payload: bytes
    retain: bool = True


Received = tuple[str, bytes]


def _acknowledged(info: paho.MQTTMessageInfo) -> bool:
    try:
        return info.is_published()
    except RuntimeError:  # published while disconnected: queued, re-sent by paho after reconnecting
        return bool(getattr(info, "_published", False))


class MqttClient:
    """One MQTT connection, by default with a persistent session; received messages queue up for ``poll``.

    Daemons use a persistent session (the broker queues QoS 1 messages while they are away); tools
    such as the monitor pass ``persistent=False`` so they leave nothing behind on the broker.
    """

    def __init__(
        self,
        client_id: str,
        settings: BrokerSettings,
        *,
        will: Will | None = None,
        on_connect: Callable[[], None] | None = None,
        queue_size: int = 256,  # x ~1 MiB chunks: at most ~256 MiB waiting; a full queue slows the broker
        persistent: bool = True,
    ) -> None:
        self.client_id = client_id
        self.settings = settings
        self.connected = threading.Event()
        self.inbox: queue.Queue[Received] = queue.Queue(maxsize=queue_size)
        self._subscriptions: dict[str, int] = {}
        self._on_connect_hook = on_connect
        v5 = settings.protocol == "5"
        self._persistent = persistent
        self._client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
            clean_session=None if v5 else not persistent,
        )
        if settings.username is not None:
            self._client.username_pw_set(settings.username, settings.password)
        if settings.tls is not None:
            self._client.tls_set(
                ca_certs=settings.tls.ca_certs,
                certfile=settings.tls.certfile,
                keyfile=settings.tls.keyfile,
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
            )
        if will is not None:
            self._client.will_set(will.topic, will.payload, qos=1, retain=will.retain)
        self._client.reconnect_delay_set(int(settings.reconnect_min_s), int(settings.reconnect_max_s))
        self._client.on_connect = self._handle_connect
        self._client.on_disconnect = self._handle_disconnect
        self._client.on_message = self._handle_message

    # lifecycle -------------------------------------------------------------------------------------
    def start(self, timeout_s: float | None = None) -> bool:
        """Connect in the background (paho retries with back-off); optionally wait for the first CONNACK."""
        s = self.settings
        kwargs: dict[str, object] = {}
        if s.protocol == "5":
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = SESSION_EXPIRY_S if self._persistent else 0
            kwargs = {"clean_start": not self._persistent, "properties": props}
        self._client.connect_async(s.host, s.port, keepalive=s.keepalive_s, **kwargs)
        self._client.loop_start()
        return self.connected.wait(timeout_s) if timeout_s is not None else False

    def stop(self) -> None:
        """Disconnect cleanly (no LWT) and stop the network thread."""
        self.connected.clear()  # first, so the disconnect below is not reported as a lost connection
        self._client.disconnect()
        self._client.loop_stop()

    # messaging ---------------------------------------------------------------------------------------
    def subscribe(self, pattern: str, qos: int = 1) -> None:
        """Subscribe now and after every reconnect (a restarted broker may have lost the session)."""
        self._subscriptions[pattern] = qos
        if self.connected.is_set():
            self._client.subscribe(pattern, qos)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> paho.MQTTMessageInfo:
        """Queue a message; QoS 1 messages survive a disconnect and go out after reconnecting."""
        return self._client.publish(topic, payload, qos=qos, retain=retain)

    def publish_all(self, items: Iterable[tuple[str, bytes]], *, retain: bool = False) -> list[paho.MQTTMessageInfo]:
        return [self.publish(topic, payload, retain=retain) for topic, payload in items]

    @staticmethod
    def wait_published(infos: list[paho.MQTTMessageInfo], timeout_s: float) -> bool:
        """Wait until the broker acknowledged every message (QoS 1 PUBACK); False on time-out.

        A message published while disconnected keeps ``rc = MQTT_ERR_NO_CONN`` even after paho re-sends
        it on reconnect and it is acknowledged, so ``is_published()`` raises for it forever; its
        acknowledgement is then read from the ``_published`` flag paho sets on PUBACK.
        """
        deadline = time.monotonic() + timeout_s
        for info in infos:
            while not _acknowledged(info):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
        return True

    def poll(self, timeout_s: float) -> Received | None:
        """The next received ``(topic, payload)``, or None after ``timeout_s``."""
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    # paho callbacks (network thread) -----------------------------------------------------------------
    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if reason_code.is_failure:
            log.warning("mqtt connect refused client=%s reason=%s", self.client_id, reason_code)
            return
        for pattern, qos in self._subscriptions.items():
            client.subscribe(pattern, qos)
        log.info(
            "mqtt connected client=%s broker=%s:%d session_present=%s",
            self.client_id,
            self.settings.host,
            self.settings.port,
            flags.session_present,
        )
        self.connected.set()
        if self._on_connect_hook is not None:
            self._on_connect_hook()

    def _handle_disconnect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if self.connected.is_set():
            log.warning("mqtt disconnected client=%s reason=%s; reconnecting", self.client_id, reason_code)
        self.connected.clear()

    def _handle_message(self, client, userdata, message: paho.MQTTMessage) -> None:  # noqa: ANN001
        self.inbox.put((message.topic, message.payload))
