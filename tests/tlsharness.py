"""Shared by the tests that run a real mosquitto from `skyfed provision`'s files: a raw TLS client per node
that records what the broker delivers to it, a connection probe, and an ``observer`` that reads every
topic (a message it does not see, the broker dropped)."""

from __future__ import annotations

from pathlib import Path

import paho.mqtt.client as paho

from protocol.mqtt import BrokerSettings, MqttClient, TlsSettings
from tests.fedharness import wait_until


def node_tls(folder: Path, name: str) -> TlsSettings:
    """A provisioned node's TLS settings: the CA, its certificate (CN = ``name``) and that certificate's key."""
    return TlsSettings(str(folder / "ca.crt"), str(folder / f"{name}.crt"), str(folder / f"{name}.crt.key"))


class Client:
    """A raw paho client with one node's provisioned certificate, recording what it receives. Its client id is
    ``<name>-raw``, so it does not take over the connection of a daemon running under the same certificate."""

    def __init__(self, folder: Path, name: str, port: int, *subscriptions: str, transport: str = "tcp") -> None:
        self.received: list[tuple[str, bytes]] = []
        self.granted: list[int] = []
        tls = node_tls(folder, name)
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"{name}-raw", transport=transport)
        self.client.tls_set(ca_certs=tls.ca_certs, certfile=tls.certfile, keyfile=tls.keyfile)
        self.client.on_message = lambda _c, _u, m: self.received.append((m.topic, m.payload))
        self.client.on_subscribe = lambda _c, _u, _m, codes, _p: self.granted.extend(c.value for c in codes)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        wait_until(self.client.is_connected, 5, f"{name} connected")
        for topic in subscriptions:
            self.subscribe(topic)

    def subscribe(self, topic: str) -> None:
        """Subscribe and wait for the broker's answer (granted or not: the ACL filters deliveries)."""
        answered = len(self.granted)
        self.client.subscribe(topic, 1)
        wait_until(lambda: len(self.granted) > answered, 5, f"the subscription to {topic} answered")

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)

    def topics(self) -> set[str]:
        return {topic for topic, _ in self.received}

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def connects(tls: TlsSettings, port: int) -> bool:
    client = MqttClient("probe", BrokerSettings("127.0.0.1", port, tls=tls), persistent=False)
    try:
        return client.start(timeout_s=2)
    finally:
        client.stop()


def add_observer(out: Path) -> None:
    """Let a client ``observer`` read every topic (its certificate is issued by the test)."""
    acl = out / "broker" / "skyfed.acl"
    acl.write_text(acl.read_text() + "\nuser observer\ntopic read skyfed/#\n")
