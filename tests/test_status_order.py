"""A device's statuses reach the broker in the order it made them, across a reconnect (``agent.edge_node``).

paho re-sends what the dead connection left unacknowledged only after the new connection's ``on_connect``, and
sends a new message at once from the moment the new socket is up: a status made then would overtake the older
one, the broker would retain the older, and the server refuse it as older. Driven here through the client's own
paho callbacks, with no broker: what the test controls is the order of events, not their timing."""

from __future__ import annotations

import paho.mqtt.client as paho
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from agent.config import load_agent_config
from agent.daemon import EdgeAgent
from agent.edge_node import STATUS_HOLD_S
from sim.federation import SimSettings, create_federation


@pytest.fixture
def agent(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    agent = EdgeAgent(load_agent_config(layout.agent_configs["agent-01"]))  # never started: paho queues what it sends
    yield agent
    agent.runner.close()


def connect(mqtt) -> None:  # noqa: ANN001
    """As paho's network thread does once the broker accepted the connection (before it re-sends anything)."""
    mqtt._handle_connect(mqtt._client, None, paho.ConnectFlags(session_present=False),
                         ReasonCode(PacketTypes.CONNACK, "Success"), None)  # fmt: skip


def acknowledge(mqtt, info: paho.MQTTMessageInfo) -> None:  # noqa: ANN001
    mqtt._handle_publish(mqtt._client, None, info.mid, ReasonCode(PacketTypes.PUBACK, "Success"), None)


def test_a_new_connection_s_status_waits_for_the_older_one_paho_re_sends(agent):
    edge, mqtt = agent.edge, agent.edge.mqtt
    older = agent.report.publish(force=True)
    assert older is not None  # queued by paho, unacknowledged
    assert agent.report.publish(force=True) is None  # disconnected: a newer one waits behind it
    connect(mqtt)
    assert mqtt.connected.is_set() and agent.report.publish(force=True) is None  # paho has not re-sent it yet
    acknowledge(mqtt, older)  # re-sent on the new connection and acknowledged: the loop is woken for it
    assert mqtt.waiting() and mqtt.poll(0) is None
    edge.tick()  # says again where it stands, now behind what paho re-sent
    newest = edge._last
    assert newest is not None and newest[0] is not older and newest[1] == mqtt.connections == 1


def test_a_status_in_flight_on_the_same_connection_holds_nothing_back(agent):
    mqtt = agent.edge.mqtt
    connect(mqtt)
    first = agent.report.publish(force=True)
    second = agent.report.publish(force=True)  # the first still unacknowledged, on this connection: order is kept
    assert first is not None and second is not None and second is not first


def test_the_hold_ends_after_a_while_on_the_new_connection_and_never_holds_the_final_status(agent):
    """An older status paho never gets acknowledged holds the new connection's for ``STATUS_HOLD_S`` at most; the
    final status of a clean stop is never held (an older one gets a moment to go first)."""
    edge, mqtt = agent.edge, agent.edge.mqtt
    older = agent.report.publish(force=True)
    connect(mqtt)
    assert agent.report.publish(force=True) is None
    mqtt._connected_at -= STATUS_HOLD_S  # as if connected that long, the older one still unacknowledged
    fresh = agent.report.publish(force=True)
    assert fresh is not None and fresh is not older
    connect(mqtt)  # a newer connection, the fresh one unacknowledged in turn: held again, but not the final status
    assert agent.report.publish(force=True) is None
    final = edge.publish_final_status()
    assert final is not None and agent.state == "offline" and edge._last is not None and edge._last[0] is final
