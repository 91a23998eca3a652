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
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

log = logging.getLogger("skyfed.mqtt")

EVICTION_WINDOW_S = 5.0  # a connection lost this soon after the broker accepted it, twice running: evicted
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


def describe_connect_error(exc: BaseException | None, settings: BrokerSettings) -> str:
    """Why a connection attempt failed, in words, with the likely fix (``broker.*`` config keys)."""
    where = f"{settings.host}:{settings.port}"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve broker host {settings.host!r} ({exc.strerror}): check broker.host"
    if isinstance(exc, ConnectionRefusedError):
        return f"nothing listens on {where}: is the broker running, and is broker.port right?"
    if isinstance(exc, TimeoutError):
        return f"no answer from {where}: wrong broker.host, or a firewall drops the connection"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the broker's certificate does not verify ({exc.verify_message}): {_verify_fix(exc, settings)}"
    tls_cut = settings.tls is not None and isinstance(exc, ConnectionResetError | BrokenPipeError)
    if isinstance(exc, ssl.SSLError) or tls_cut:
        why = exc.reason if isinstance(exc, ssl.SSLError) else "the broker hung up"
        return (
            f"TLS handshake with {where} failed ({why or exc}): is broker.port a TLS listener, and do "
            "broker.tls.certfile/keyfile belong to a CA the broker trusts?"
        )
    if isinstance(exc, OSError):
        return f"cannot connect to {where}: {exc.strerror or exc}"
    return f"cannot connect to {where}"


def _verify_fix(exc: ssl.SSLCertVerificationError, settings: BrokerSettings) -> str:
    """What to change for OpenSSL's verify code (X509_V_ERR_*): wrong name, out of date, or an unknown CA."""
    if exc.verify_code in (62, 64):  # HOSTNAME_MISMATCH, IP_ADDRESS_MISMATCH
        return f"the certificate is not for {settings.host!r}: set broker.host to a name it holds, or re-issue it"
    if exc.verify_code in (9, 10):  # NOT_YET_VALID, HAS_EXPIRED
        return "re-issue the broker's certificate (or check this host's clock)"
    return "check broker.tls.ca_certs (the CA that signed the broker's certificate)"


def describe_refusal(reason: object, settings: BrokerSettings) -> str:
    """A CONNACK refusal, with what to check."""
    text = str(reason)
    if "password" in text.lower() or "authori" in text.lower():
        fix = "check broker.username/password, or that the client certificate's CN is this node's id"
    elif "identifier" in text.lower():
        fix = "another client may use this id, or the id is not allowed by the broker"
    else:
        fix = "see the broker's log"
    return f"broker {settings.host}:{settings.port} refused the connection ({text}): {fix}"


def taken_over_text(client_id: str, settings: BrokerSettings) -> str:
    """Why the broker closed a connection for another client with the same id, and what that id is."""
    who = f"client id {client_id!r}"
    if settings.tls is not None and settings.tls.certfile:  # mosquitto's use_username_as_clientid
        who += f" (with TLS the broker uses the certificate name: {settings.tls.certfile} is in use elsewhere)"
    return (
        f"another client is connected with this {who}: the broker closes one connection for the other "
        "(twice running right after accepting it, or MQTT 5's 'Session taken over'); run one client per id"
    )


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
        will: Will | Callable[[], Will] | None = None,
        on_connect: Callable[[], None] | None = None,
        queue_size: int = 256,  # x ~1 MiB chunks: at most ~256 MiB waiting; a full queue slows the broker
        persistent: bool = True,
    ) -> None:
        self.client_id = client_id
        self.settings = settings
        self.connected = threading.Event()
        self.session_present = False  # as the broker's last CONNACK said: False after it lost our session
        self.inbox: queue.Queue[Received] = queue.Queue(maxsize=queue_size)
        self._subscriptions: dict[str, int] = {}
        self._on_connect_hook = on_connect
        self.problem: str | None = None  # why the broker is unreachable or refuses us, in words; None when fine
        self._stopping = False
        self._pending_subscribes: dict[int, str] = {}
        self.taken_over = False  # the broker closed us because another client connected with our client id
        self._connected_at = 0.0
        self._quick_drops = 0  # consecutive connections lost within EVICTION_WINDOW_S of being accepted
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
        self._will = will  # a callable makes a new will for every connection (after each connect, for the next)
        self._set_will()
        self._client.reconnect_delay_set(int(settings.reconnect_min_s), int(settings.reconnect_max_s))
        self._client.on_connect = self._handle_connect
        self._client.on_connect_fail = self._handle_connect_fail
        self._client.on_disconnect = self._handle_disconnect
        self._client.on_message = self._handle_message
        self._client.on_subscribe = self._handle_subscribe
        self._client.on_publish = self._handle_publish

    def _set_will(self) -> None:
        will = self._will() if callable(self._will) else self._will
        if will is not None:
            self._client.will_set(will.topic, will.payload, qos=1, retain=will.retain)

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

    def stop(self, timeout_s: float | None = None) -> bool:
        """Disconnect cleanly (no LWT) and stop the network thread; False if it did not end within ``timeout_s``.

        While the broker is gone that thread may sit out a reconnect back-off (paho sleeps in 1 s steps)
        or a TCP connect to an unreachable host (paho's 5 s connect timeout): a daemon that must exit
        promptly leaves it behind. It is a daemon thread, told to stop, so it cannot keep the process alive.
        """
        self._stopping = True  # first, so the disconnect below is not reported as a problem
        self.connected.clear()
        self._client.disconnect()
        stopper = threading.Thread(target=self._client.loop_stop, name=f"mqtt-stop-{self.client_id}", daemon=True)
        stopper.start()  # loop_stop() itself joins the network thread without a time limit
        stopper.join(timeout_s)
        return not stopper.is_alive()

    # messaging ---------------------------------------------------------------------------------------
    def subscribe(self, pattern: str, qos: int = 1) -> None:
        """Subscribe now and after every reconnect (a restarted broker may have lost the session)."""
        self._subscriptions[pattern] = qos
        if self.connected.is_set():
            self._subscribe(self._client, pattern, qos)

    def _subscribe(self, client: paho.Client, pattern: str, qos: int) -> None:
        _, mid = client.subscribe(pattern, qos)
        self._pending_subscribes[mid] = pattern

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

    @staticmethod
    def all_acknowledged(infos: list[paho.MQTTMessageInfo]) -> bool:
        """``wait_published`` without waiting: has the broker acknowledged every message yet?"""
        return all(_acknowledged(info) for info in infos)

    def poll(self, timeout_s: float) -> Received | None:
        """The next received ``(topic, payload)``, or None after ``timeout_s``."""
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def report_problem(self, problem: str | None) -> None:
        """A problem the caller found on this connection (its messages never come back, say): logged once and
        shown as ours are (status, systemd), until the next (re)connect clears it."""
        self._report(problem)

    # paho callbacks (network thread) -----------------------------------------------------------------
    def _report(self, problem: str | None) -> None:
        """Log a change of connection problem once (paho retries with back-off; repeats stay quiet)."""
        if problem != self.problem and problem is not None:
            log.warning("mqtt unreachable client=%s reason=%s", self.client_id, problem)
        self.problem = problem

    def _handle_connect_fail(self, client, userdata) -> None:  # noqa: ANN001
        # paho calls this from inside its ``except OSError`` block, so the exception is the one handled now
        self._report(describe_connect_error(sys.exc_info()[1], self.settings))

    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if reason_code.is_failure:
            self._report(describe_refusal(reason_code, self.settings))
            return
        self._report(None)
        self._connected_at = time.monotonic()
        self._pending_subscribes.clear()  # acknowledgements lost with the previous connection never come
        for pattern, qos in self._subscriptions.items():
            self._subscribe(client, pattern, qos)
        log.info(
            "mqtt connected client=%s broker=%s:%d session_present=%s",
            self.client_id,
            self.settings.host,
            self.settings.port,
            flags.session_present,
        )
        self.session_present = bool(flags.session_present)
        self.connected.set()
        if self._on_connect_hook is not None:
            self._on_connect_hook()
        if callable(self._will):
            self._set_will()

    def _handle_disconnect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if self._stopping:
            return
        if self.connected.is_set() and self._evicted(str(reason_code)):
            self.taken_over = True
            self._report(taken_over_text(self.client_id, self.settings))
        elif self.connected.is_set():
            log.warning("mqtt disconnected client=%s reason=%s; reconnecting", self.client_id, reason_code)
            self.problem = f"connection lost ({reason_code}); reconnecting"
        elif self.problem is None and self.settings.tls is None:
            self._report(
                f"{self.settings.host}:{self.settings.port} closed the connection before answering: a TLS "
                "listener? (set [broker.tls]) or a broker that does not speak MQTT on this port"
            )
        self.connected.clear()

    def _evicted(self, reason: str) -> bool:
        """Whether another client with our id took the connection: MQTT 5 may say so ("Session taken over");
        otherwise (mosquitto 2.0 sends no reason) it shows as a second drop in a row, each soon after connecting."""
        quick = time.monotonic() - self._connected_at < EVICTION_WINDOW_S
        self._quick_drops = self._quick_drops + 1 if quick else 0
        return reason == "Session taken over" or self._quick_drops >= 2

    def _handle_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:  # noqa: ANN001
        pattern = self._pending_subscribes.pop(mid, "?")
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        if refused:
            reasons = ", ".join(refused)
            self._report(f"subscription to {pattern} refused ({reasons}): check the broker's ACL for this id")

    def _handle_publish(self, client, userdata, mid, reason_code, properties) -> None:  # noqa: ANN001
        if reason_code.is_failure:  # MQTT 5 only: mosquitto says 0x87 "Not authorized" where 3.1.1 acks silently
            self._report(
                f"the broker refused a message ({reason_code}): its ACL does not let {self.client_id!r} publish "
                "there (after skyfed provision added this id: systemctl reload mosquitto on the broker host)"
            )

    def _handle_message(self, client, userdata, message: paho.MQTTMessage) -> None:  # noqa: ANN001
        # A full queue holds paho's thread (the broker then waits on us) until the caller polls, or until
        # ``stop``: a caller that stopped polling must not leave this thread blocked for ever.
        while not self._stopping:
            try:
                self.inbox.put((message.topic, message.payload), timeout=0.5)
                return
            except queue.Full:
                continue
