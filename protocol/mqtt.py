"""A thin MQTT client over paho-mqtt 2.x: QoS 1, persistent sessions, LWT, reconnect with back-off, TLS.

Deliberately small (see STYLE.md on paho's own 5,000-line client): it connects, keeps the session,
re-subscribes after every (re)connect, and hands received messages to the caller's thread through a
bounded queue, so decryption, aggregation and training never run on paho's network thread (which must
keep answering keep-alives). Chunking, schemas and round logic live elsewhere. Works with MQTT 3.1.1
and 5: everything SkyFed needs is in the payloads (nats-server 2.9 speaks 3.1.1 only). Over a clustered
broker it tries the nodes in turn (``BrokerSettings.fallbacks``).
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from protocol.broker_settings import BrokerSettings, TlsSettings, parse_address  # noqa: F401 - their importers use this module
from protocol.mqtt_problems import describe_connect_error, describe_disconnect, describe_refusal, taken_over_text

log = logging.getLogger("skyfed.mqtt")

EVICTION_WINDOW_S = 5.0  # a connection lost this soon after the broker accepted it, twice running: evicted
SESSION_EXPIRY_S = 7 * 24 * 3600  # MQTT 5: keep the session (and queued QoS 1 messages) for a week
CLOSE_DRAIN_S = 0.3  # after our DISCONNECT, how long to read what the broker still sends until it closes


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
        will: Will | Callable[[], Will] | None = None,
        on_connect: Callable[[], None] | None = None,
        queue_size: int = 256,  # x ~1 MiB chunks: at most ~256 MiB waiting; a full queue slows the broker
        persistent: bool = True,
    ) -> None:
        self.client_id = client_id
        self.settings = settings
        self.connected = threading.Event()
        self.session_present = False  # as the broker's last CONNACK said: False after it lost our session
        self.inbox: queue.Queue[Received | None] = queue.Queue(maxsize=queue_size)  # None: ``wake``
        self._subscriptions: dict[str, int] = {}
        self._on_connect_hook = on_connect
        self.problem: str | None = None  # why the broker is unreachable or refuses us, in words; None when fine
        self._stopping = False
        self._pending_subscribes: dict[int, str] = {}
        # messages whose acknowledgement wakes ``poll``, by id; then those acknowledged, which paho marks as
        # published only after its callback (``_handle_publish``) returned
        self._wake_on_ack: dict[int, paho.MQTTMessageInfo] = {}
        self._acknowledged: dict[int, paho.MQTTMessageInfo] = {}
        self.protocol_refused = False  # the broker's last CONNACK refused our MQTT version (NATS 2.9 and MQTT 5)
        self.taken_over = False  # the broker closed us because another client connected with our client id
        self.connections = 0  # connections the broker accepted so far: which one a message was handed to paho on
        self._connected_at = 0.0
        self._quick_drops: set[tuple[str, int]] = set()  # nodes of a streak of connections lost right after accept
        self._addresses = settings.addresses
        self._attempts = 0  # connection attempts so far: attempt k goes to address k mod len(addresses)
        self.at = settings  # ``settings`` naming the node of the current attempt (what messages report)
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
        self._client.on_pre_connect = self._next_address
        self._client.on_connect = self._handle_connect
        self._client.on_connect_fail = self._handle_connect_fail
        self._client.on_disconnect = self._handle_disconnect
        self._client.on_message = self._handle_message
        self._client.on_subscribe = self._handle_subscribe
        self._client.on_publish = self._handle_publish
        self._client.on_socket_close = self._close_gracefully

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
        return self._wait_connected(timeout_s) if timeout_s is not None else False

    def _wait_connected(self, timeout_s: float) -> bool:
        """Until the broker accepts us, refuses our protocol version (waiting longer cannot help), or time-out."""
        deadline = time.monotonic() + timeout_s
        while not self.connected.wait(max(0.0, min(0.05, deadline - time.monotonic()))):
            if self.protocol_refused or time.monotonic() >= deadline:
                return False
        return True

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

    def all_acknowledged(self, infos: list[paho.MQTTMessageInfo]) -> bool:
        """``wait_published`` without waiting: has the broker acknowledged every message yet?"""
        return all(_acknowledged(info) or self._acknowledged.get(info.mid) is info for info in infos)

    def poll(self, timeout_s: float) -> Received | None:
        """The next received ``(topic, payload)``, or None after ``timeout_s`` or a ``wake``."""
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def waiting(self) -> bool:
        """Whether received messages (or a ``wake``) wait for ``poll``."""
        return not self.inbox.empty()

    def wake(self) -> None:
        """Make a waiting ``poll`` return None now, as after its time-out, so a daemon's loop ticks at once:
        from a handler whose message completed what the next tick acts on, or from a job's thread that
        finished. Dropped when the inbox is full: the loop is busy then, and ticks within its interval."""
        try:
            self.inbox.put_nowait(None)
        except queue.Full:
            pass

    @property
    def connected_since(self) -> float:
        """When (``time.monotonic``) the broker last accepted this connection: set before ``connected`` is."""
        return self._connected_at

    def wake_when_acknowledged(self, info: paho.MQTTMessageInfo) -> None:
        """``wake`` once the broker acknowledged ``info`` (at once if it has): what waits for it is done at once, not
        at the next tick, which a process hosting many agents makes long. An acknowledgement handled by paho's thread
        while this registers, before paho marks the message, wakes nobody: the next tick sees it."""
        for mid, done in list(self._acknowledged.items()):  # paho has marked these by now; or an earlier id's
            if (mid == info.mid and done is not info) or _acknowledged(done):
                self._acknowledged.pop(mid, None)
        self._wake_on_ack[info.mid] = info
        if _acknowledged(info) and self._wake_on_ack.pop(info.mid, None) is not None:  # before it was asked for
            self.wake()

    def report_problem(self, problem: str | None) -> None:
        """A problem the caller found on this connection (its messages never come back, say): logged once and
        shown as ours are (status, systemd), until the next (re)connect clears it."""
        self._report(problem)

    # paho callbacks (network thread) -----------------------------------------------------------------
    def _next_address(self, client, userdata) -> None:  # noqa: ANN001
        """Before each attempt, the next node in turn: paho has no address list (eclipse/paho.mqtt.python#308)
        and its ``host``/``port`` setters refuse while a reconnect is under way, so the address is written
        where ``reconnect()`` reads it (paho 2.x, pinned in constraints.txt; tests/test_nats_cluster.py)."""
        host, port = self._addresses[self._attempts % len(self._addresses)]
        self._attempts += 1
        if (host, port) != (self.at.host, self.at.port):
            self.at = replace(self.settings, host=host, port=port)
        client._host, client._port = host, port

    def _report(self, problem: str | None) -> None:
        """Log a change of connection problem once (paho retries with back-off; repeats stay quiet)."""
        if problem != self.problem and problem is not None:
            log.warning("mqtt unreachable client=%s reason=%s", self.client_id, problem)
        self.problem = problem

    def _handle_connect_fail(self, client, userdata) -> None:  # noqa: ANN001
        # paho calls this from inside its ``except OSError`` block, so the exception is the one handled now
        self._report(describe_connect_error(sys.exc_info()[1], self.at))

    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if reason_code.is_failure:
            self.protocol_refused = "protocol version" in str(reason_code).lower()
            self._report(describe_refusal(reason_code, self.at))
            return
        self._report(None)
        self._connected_at = time.monotonic()
        self.connections += 1  # before ``connected`` is set: who sees it set sees the new number
        self._pending_subscribes.clear()  # acknowledgements lost with the previous connection never come
        for pattern, qos in self._subscriptions.items():
            self._subscribe(client, pattern, qos)
        log.info(
            "mqtt connected client=%s broker=%s:%d session_present=%s",
            self.client_id,
            self.at.host,
            self.at.port,
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
            self._report(taken_over_text(self.client_id, self.at))
        elif self.connected.is_set():
            why = describe_disconnect(reason_code, self.client_id, self.at)
            log.warning("mqtt disconnected client=%s reason=%s; reconnecting", self.client_id, why)
            self.problem = f"{why}; reconnecting"
        elif self.problem is None and self.settings.tls is None:
            self._report(
                f"{self.at.host}:{self.at.port} closed the connection before answering: a TLS listener? (a "
                "daemon's [broker.tls]; skyfed monitor's --cafile, --cert and --key) or a broker that does not "
                "speak MQTT on this port"
            )
        self.connected.clear()

    def _evicted(self, reason: str) -> bool:
        """Whether another client with our id took the connection: MQTT 5 may say so ("Session taken over");
        otherwise (mosquitto 2.0 sends no reason) it shows as drops in a row, each soon after connecting, twice on
        one node: a cluster's nodes may each drop a client once while they hand its session over after a failover."""
        if time.monotonic() - self._connected_at >= EVICTION_WINDOW_S:
            self._quick_drops.clear()
            return reason == "Session taken over"
        node = (self.at.host, self.at.port)
        again = node in self._quick_drops
        self._quick_drops.add(node)
        return reason == "Session taken over" or again

    def _handle_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:  # noqa: ANN001
        pattern = self._pending_subscribes.pop(mid, "?")
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        if refused:
            reasons = ", ".join(refused)
            self._report(f"subscription to {pattern} refused ({reasons}): check the broker's ACL for this id")

    def _handle_publish(self, client, userdata, mid, reason_code, properties) -> None:  # noqa: ANN001
        if (info := self._wake_on_ack.pop(mid, None)) is not None:
            self._acknowledged[mid] = info  # ``all_acknowledged`` knows it before paho marks it
            self.wake()
        if reason_code.is_failure:  # MQTT 5 only: mosquitto says 0x87 "Not authorized" where 3.1.1 acks silently
            self._report(
                f"the broker refused a message ({reason_code}): its ACL does not let {self.client_id!r} publish "
                "there (after skyfed provision added this id: systemctl reload mosquitto on the broker host)"
            )

    def _close_gracefully(self, client, userdata, sock) -> None:  # noqa: ANN001
        """On ``stop``, after paho wrote our DISCONNECT and before it closes the socket: send FIN, then read
        and drop what the broker still sends until it closes its side (or ``CLOSE_DRAIN_S``). Closed with
        unread data, a socket sends RST; mosquitto may then fail writing to us before it reads the DISCONNECT
        and publish our last will ("closed its connection"), so a final retained status turned "offline"."""
        if not self._stopping:
            return
        deadline = time.monotonic() + CLOSE_DRAIN_S
        try:
            sock.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0:
                if select.select([sock], [], [], left)[0] and not sock.recv(65536):
                    return  # the broker's FIN: it has read our DISCONNECT
        except (OSError, ValueError):
            return  # already reset or closed: nothing to drain

    def _handle_message(self, client, userdata, message: paho.MQTTMessage) -> None:  # noqa: ANN001
        # A full queue holds paho's thread (the broker then waits on us) until the caller polls, or until
        # ``stop``: a caller that stopped polling must not leave this thread blocked for ever.
        while not self._stopping:
            try:
                self.inbox.put((message.topic, message.payload), timeout=0.5)
                return
            except queue.Full:
                continue
