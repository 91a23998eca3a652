"""Mutual TLS between the daemons and mosquitto, with certificates from security.pki."""

import json
import threading

import pytest

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from protocol.mqtt import BrokerSettings, MqttClient, TlsSettings
from security.pki import create_ca, issue
from sim.broker import ListenerTls, start_broker
from sim.federation import SimSettings, create_federation
from tests.fedharness import hosted_agent, override_toml
from tests.liveharness import problem_of


@pytest.fixture
def tls_broker(tmp_path):
    pki = tmp_path / "pki"
    ca = create_ca(pki, "tls")
    server_cert = issue(ca, pki, "localhost", hosts=("127.0.0.1", "localhost"))
    broker = start_broker(
        data_dir=tmp_path / "broker", kind="mosquitto", tls=ListenerTls(ca.cert, server_cert.cert, server_cert.key)
    )
    yield broker, ca, pki
    broker.stop()


def test_a_client_without_a_certificate_cannot_connect(tls_broker):
    broker, ca, _ = tls_broker
    client = MqttClient(
        "anonymous", BrokerSettings(host=broker.host, port=broker.port, tls=TlsSettings(str(ca.cert))), persistent=False
    )
    assert not client.start(timeout_s=2)
    client.stop()


def test_federation_round_over_mutual_tls(tmp_path, tls_broker):
    broker, ca, pki = tls_broker
    layout = create_federation(
        tmp_path / "fed", SimSettings(agents=2, rounds=1, federation="tls"), (broker.host, broker.port)
    )
    for name, config in [("server", layout.server_config), *layout.agent_configs.items()]:
        cert = issue(ca, pki, name)
        override_toml(
            config, broker={"tls": {"ca_certs": str(ca.cert), "certfile": str(cert.cert), "keyfile": str(cert.key)}}
        )
    server = Aggregator(load_server_config(layout.server_config))
    agents = [hosted_agent(p) for p in layout.agent_configs.values()]
    stop = threading.Event()
    threads = [threading.Thread(target=a.run, args=(stop,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    try:
        server.run()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    rows = [
        json.loads(line) for line in (layout.server_config.parent / "state" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 1 and sorted(rows[0]["accepted"]) == ["agent-01", "agent-02"]


def test_a_plain_client_on_the_tls_port_is_told_to_set_broker_tls(tls_broker):
    broker, _, _ = tls_broker
    assert "[broker.tls]" in problem_of(BrokerSettings(host=broker.host, port=broker.port))


def test_a_certificate_from_another_ca_does_not_verify_and_says_which_key(tls_broker, tmp_path):
    broker, _, _ = tls_broker
    other = create_ca(tmp_path / "other", "other")
    problem = problem_of(BrokerSettings(host="localhost", port=broker.port, tls=TlsSettings(str(other.cert))))
    assert "does not verify" in problem and "broker.tls.ca_certs" in problem
