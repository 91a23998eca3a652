"""``[broker] fallbacks``: a client tries a cluster's other nodes in turn, and bad addresses fail at start.

Two independent mosquittos stand in for two nodes here (they share no session: only the choice of node is
tested); tests/test_nats_cluster.py runs a federation over a real NATS cluster.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from protocol.config import ConfigError, broker_settings
from protocol.mqtt import BrokerSettings, MqttClient
from sim.broker import free_port, start_broker
from sim.nats_cluster import spread_broker_table
from tests.fedharness import wait_until


def client_on(settings: BrokerSettings) -> MqttClient:
    client = MqttClient("probe", settings, persistent=False)
    client.start()
    return client


def test_a_dead_first_node_is_passed_over_for_the_next(broker):
    dead = free_port()  # nothing listens there
    client = client_on(BrokerSettings(host="127.0.0.1", port=dead, fallbacks=(broker.address,)))
    try:
        assert client.connected.wait(15), client.problem
        assert (client.at.host, client.at.port) == (broker.host, broker.port)
    finally:
        client.stop()


def test_a_client_moves_to_the_next_node_when_its_node_dies_and_comes_back_round(broker, tmp_path):
    second = start_broker(data_dir=tmp_path / "second", kind="mosquitto")
    client = client_on(BrokerSettings(host=broker.host, port=broker.port, fallbacks=(second.address,)))
    try:
        assert client.connected.wait(10)
        assert client.at.port == broker.port
        broker.kill()
        wait_until(lambda: client.connected.is_set() and client.at.port == second.port, 20, "the second node")
        broker.start()
        second.kill()
        wait_until(lambda: client.connected.is_set() and client.at.port == broker.port, 20, "the first node again")
    finally:
        client.stop()
        second.stop()


def test_one_address_behaves_as_before(broker):
    settings = BrokerSettings.from_address(broker.address)
    assert settings.fallbacks == () and settings.addresses == [(broker.host, broker.port)]
    assert settings.address_list == broker.address


@pytest.mark.parametrize(
    "fallbacks, key",
    [(["h2"], "broker.fallbacks[0]"), (["h2:1883", "h3:0"], "broker.fallbacks[1]"), ("h2:1883", "broker.fallbacks")],
)
def test_bad_fallbacks_fail_at_start_naming_the_key(fallbacks, key):
    with pytest.raises(ConfigError) as refused:
        broker_settings(Path("agent.toml"), {"broker": {"host": "h1", "port": 1883, "fallbacks": fallbacks}})
    assert str(refused.value).startswith(f"agent.toml: {key} ")


def test_a_comma_separated_address_is_a_cluster():
    settings = BrokerSettings.from_address("n1:4001, n2:4002,n3:4003")
    assert settings.addresses == [("n1", 4001), ("n2", 4002), ("n3", 4003)]
    with pytest.raises(ValueError, match="broker address 'n2'"):
        BrokerSettings.from_address("n1:4001,n2")


def test_a_federation_spreads_over_the_nodes_each_with_the_others_as_fallbacks():
    nodes = ["n1:1", "n2:2", "n3:3"]
    tables = [spread_broker_table(nodes, k) for k in range(4)]  # the server, then agent-01 .. agent-03
    assert [t["host"] for t in tables] == ["n1", "n2", "n3", "n1"]
    assert tables[1]["fallbacks"] == ["n3:3", "n1:1"]
    assert spread_broker_table(["n1:1"], 0) == {"host": "n1", "port": 1}  # one broker: the config as before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--broker-cluster", "nats:2"], "--broker-cluster 'nats:2' must look like nats:N with N = 3-9 nodes"),
        (["--broker-cluster", "rabbit:3"], "must look like nats:N"),
        (["--broker-cluster", "nats:3", "--broker", "127.0.0.1:1883"], "drop --broker"),
        (["--broker-cluster", "nats:3", "--in-process"], "drop --in-process"),
        (["--broker-cluster", "nats:3", "--mode", "peer"], "drop --mode peer"),
        (["--broker", "127.0.0.1:1883,127.0.0.1:1884", "--mode", "peer"], "--mode peer takes one --broker"),
        (["--broker", "127.0.0.1:1883,nowhere"], "broker address 'nowhere' must look like HOST:PORT"),
    ],
)
def test_sim_refuses_bad_cluster_arguments_with_a_message(args, message, capsys):
    """In this process: a refusal comes before the sim touches the process (its loggers, its SIGTERM handler)."""
    from skyfed import main

    before = signal.getsignal(signal.SIGTERM)
    assert main(["sim", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("skyfed sim: "), err
    assert signal.getsignal(signal.SIGTERM) is before


def test_provision_refuses_a_cluster_address_rather_than_drop_its_other_nodes(tmp_path, capsys):
    from skyfed import main

    out = tmp_path / "fed"
    assert main(["provision", "--federation", "f", "--agents", "a1", "--out", str(out), "--broker", "n1:1,n2:2"]) == 2
    assert "[broker] fallbacks" in capsys.readouterr().err and not (out / "a1").exists()
