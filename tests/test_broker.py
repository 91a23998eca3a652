"""The local broker behaves the way SkyFed relies on (real mosquitto, real paho clients)."""

import hashlib
import os
import threading

import paho.mqtt.client as paho
import pytest

from sim.broker import LISTEN_PORTS_FROM, ephemeral_ports_from, free_port, start_broker


def client(broker, client_id, clean=True, messages=None):
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean)
    got = threading.Event()
    if messages is not None:

        def on_message(_c, _u, m):
            messages.append(m.payload)
            got.set()

        c.on_message = on_message
    c.connect(broker.host, broker.port)
    c.loop_start()
    return c, got


def subscribe(c, topic):
    """Subscribe and wait for the broker's SUBACK, so that what is published next is delivered."""
    answered = threading.Event()
    c.on_subscribe = lambda *_: answered.set()
    c.subscribe(topic, 1)
    assert answered.wait(5)


def publish(broker, topic, payload, retain=False):
    c, _ = client(broker, "pub")
    c.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)
    c.disconnect()
    c.loop_stop()


def test_retained_message_reaches_a_later_subscriber(broker):
    publish(broker, "t/r", b"hello", retain=True)
    messages = []
    c, got = client(broker, "late", messages=messages)
    c.subscribe("t/r", 1)
    assert got.wait(5) and messages == [b"hello"]
    c.disconnect()


def test_persistent_session_gets_messages_queued_while_away_even_across_a_restart(broker):
    messages = []
    c, got = client(broker, "persistent", clean=False, messages=messages)
    subscribe(c, "t/q")
    c.disconnect()
    c.loop_stop()
    publish(broker, "t/q", b"while-away")
    publish(broker, "t/keep", b"retained", retain=True)
    broker.restart()
    c, got = client(broker, "persistent", clean=False, messages=messages)
    assert got.wait(5) and messages == [b"while-away"]
    c.disconnect()
    later = []
    c2, got2 = client(broker, "late", messages=later)
    c2.subscribe("t/keep", 1)
    assert got2.wait(5) and later == [b"retained"]
    c2.disconnect()


@pytest.mark.parametrize("kind", ["mosquitto", "iotcore"])
def test_an_8_mib_payload_arrives_intact(tmp_path, kind):
    if kind == "iotcore":
        pytest.importorskip("iotcore")
    with start_broker(data_dir=tmp_path / kind, kind=kind) as b:
        data = os.urandom(8 << 20)
        messages = []
        c, got = client(b, "big", messages=messages)
        subscribe(c, "t/big")
        publish(b, "t/big", data)
        assert got.wait(10)
        assert hashlib.sha256(messages[0]).digest() == hashlib.sha256(data).digest()
        c.disconnect()


def test_two_brokers_get_different_free_ports(tmp_path):
    with start_broker(data_dir=tmp_path / "a") as a, start_broker(data_dir=tmp_path / "b") as b:
        assert a.port != b.port


def test_free_ports_lie_below_the_ephemeral_range_so_no_outgoing_connection_takes_a_restarting_brokers_port(tmp_path):
    ports = [free_port() for _ in range(300)]
    assert all(LISTEN_PORTS_FROM <= port < ephemeral_ports_from() for port in ports)
    assert len(set(ports)) == len(ports)  # never one twice: a cluster draws all its ports before any listens
    unreadable = tmp_path / "ip_local_port_range"
    unreadable.write_text("garbage\n")
    assert ephemeral_ports_from(unreadable) == 32768
    unreadable.write_text("40000\t60999\n")
    assert ephemeral_ports_from(unreadable) == 40000
