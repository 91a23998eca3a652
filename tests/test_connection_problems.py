"""A daemon that cannot reach or use its broker says why, once, with the fix — never silence."""

import logging
import time

from protocol.mqtt import BrokerSettings, MqttClient, TlsSettings
from sim.broker import accepts, free_port, start_broker
from tests.fedharness import hosted_agent, wait_until
from tests.liveharness import problem_of


def unreachable_lines(caplog) -> list[str]:  # noqa: ANN001
    return [r.getMessage() for r in caplog.records if "mqtt unreachable" in r.getMessage()]


def test_nothing_listening_is_said_once_with_the_fix_and_cleared_when_the_broker_comes(tmp_path, caplog):
    port = free_port()
    client = MqttClient("probe", BrokerSettings(host="127.0.0.1", port=port), persistent=False)
    caplog.set_level(logging.WARNING, logger="skyfed.mqtt")
    client.start()
    try:
        wait_until(lambda: client.problem, 10, "a connection problem")
        time.sleep(2.5)  # paho retries with back-off meanwhile: the same problem is not logged again
        (line,) = unreachable_lines(caplog)
        assert f"nothing listens on 127.0.0.1:{port}" in line and "broker.port" in line
        broker = start_broker(data_dir=tmp_path / "broker", kind="mosquitto", port=port)
        try:
            assert client.connected.wait(20) and client.problem is None
        finally:
            broker.stop()
    finally:
        client.stop()


def test_an_unresolvable_host_names_the_key_to_fix():
    problem = problem_of(BrokerSettings(host="no-such-broker.invalid", port=free_port()))  # never reached
    assert "cannot resolve broker host 'no-such-broker.invalid'" in problem and "broker.host" in problem


def test_a_tls_client_on_a_plain_port_is_told_about_tls(broker, tmp_path):
    from security.pki import create_ca

    ca = create_ca(tmp_path / "pki", "t")
    problem = problem_of(BrokerSettings(host=broker.host, port=broker.port, tls=TlsSettings(str(ca.cert))))
    assert "TLS handshake" in problem and "TLS listener" in problem


def test_status_says_unreachable_with_the_reason_while_there_is_a_problem(tmp_path):
    from sim.federation import SimSettings, create_federation

    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="c"), ("127.0.0.1", 1))
    agent = hosted_agent(layout.agent_configs["agent-01"])
    assert agent.report.status().state != "unreachable"
    refused = "subscription to skyfed/c/round refused (Not authorized): check the broker's ACL for this id"
    agent.edge.mqtt.problem = refused
    status = agent.report.status()
    assert status.state == "unreachable" and "check the broker's ACL" in status.detail


def test_refused_credentials_name_the_keys_to_check(tmp_path):
    import subprocess

    from sim.broker import mosquitto_path

    passwords = tmp_path / "passwords"
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(passwords), "server", "right"], check=True)
    port = free_port()
    config = tmp_path / "mosquitto.conf"
    user = __import__("getpass").getuser()  # as root, mosquitto would switch to a user that cannot read tmp_path
    config.write_text(f"listener {port} 127.0.0.1\nuser {user}\nallow_anonymous false\npassword_file {passwords}\n")
    broker = subprocess.Popen([mosquitto_path(), "-c", str(config)], stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: accepts("127.0.0.1", port), 10, "mosquitto to listen")
        problem = problem_of(BrokerSettings(host="127.0.0.1", port=port, username="server", password="wrong"))
        assert "refused the connection" in problem and "broker.username/password" in problem
    finally:
        broker.terminate()
        broker.wait(10)
