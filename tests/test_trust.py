"""The server's trust while it runs: enrolment without a restart and group-key rotation on a schedule
(revocation over TLS is in test_provision.py)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from broker_server.pool import POOL
from protocol.config import ConfigError
from protocol.messages import AgentStatus, RoundTask
from protocol.mqtt import MqttClient
from security.keys import Identity, PublicIdentity, enroll
from security.signing import signed_payload
from tests.fedharness import Federation, override_toml, wait_until


def test_the_group_key_rotates_before_every_nth_round_and_rounds_go_on(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=3, agents=2)
    override_toml(fed.layout.server_config, keys={"rotate_every_rounds": 1})
    server = Aggregator(load_server_config(fed.layout.server_config))
    tasks: dict[int, str] = {}
    watcher = MqttClient("watcher", server.config.broker, persistent=False)
    watcher.subscribe(server.topics.round)
    assert watcher.start(timeout_s=5)

    def record() -> None:
        while (msg := watcher.poll(0.2)) is not None or not stop.is_set():
            if msg is not None and msg[1]:
                from common.untrusted_json import parse_untrusted_json

                body = parse_untrusted_json(msg[1], max_bytes=1 << 20)["body"]
                tasks[RoundTask.from_dict(body).round] = body["group_key_id"]

    stop = threading.Event()
    recorder = threading.Thread(target=record, daemon=True)
    recorder.start()
    try:
        fed.run(server)
    finally:
        stop.set()
        recorder.join(5)
        watcher.stop()
    assert [sorted(m.accepted) for m in fed.metrics()] == [["agent-01", "agent-02"]] * 3
    assert sorted(tasks) == [1, 2, 3] and len(set(tasks.values())) == 3, tasks
    assert (server.config.state_dir / "group.key").read_bytes()[:8].decode() == tasks[3]


def test_an_agent_enrolled_while_the_server_runs_joins_without_a_restart(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=100, agents=3)
    override_toml(fed.layout.server_config, rounds={"min_agents": 2, "quorum": 2})
    enrolled = fed.layout.server_config.parent / "enrolled"
    late = enrolled / "agent-03.pub"
    public = PublicIdentity.load(late)
    late.unlink()
    server = Aggregator(load_server_config(fed.layout.server_config))
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    thread.start()
    fed.start_agents()
    try:
        wait_until(lambda: server.engine.next_round >= 2, 60, "round 1 without agent-03")
        enroll(enrolled, public)
        wait_until(lambda: any("agent-03" in m.accepted for m in fed.metrics()), 60, "a round with agent-03")
        key_id = server.group_keys.key.key_id
        (enrolled / "agent-01.pub").write_bytes((enrolled / "agent-01.pub").read_bytes() + b"\n")  # same key
        time.sleep(2.5)  # two polls of the enrolled folder
        assert server.group_keys.key.key_id == key_id and "agent-01" in server.registry.keyring
    finally:
        stop.set()
        thread.join(15)
        fed.close()
    assert sorted(fed.metrics()[0].accepted) == ["agent-01", "agent-02"]


def test_an_agent_enrolled_as_the_pools_name_while_the_server_runs_is_refused_and_never_selected(
    tmp_path, broker, caplog
):
    """The start check refuses a key enrolled as ``server-pool`` beside ``[pool]``; on main the enrolled folder's
    watcher took one that appeared later, and the next round selected ``server-pool`` twice."""
    fed = Federation(tmp_path, broker, rounds=100, agents=2, model="mlp_digits", share_ratio=0.25,
                     strategy={"name": "fedavg"})  # fmt: skip
    caplog.set_level(logging.INFO, logger="skyfed.server")
    server, stop = Aggregator(load_server_config(fed.layout.server_config)), threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    thread.start()
    fed.start_agents()
    impostor = Identity.generate(POOL)
    try:
        wait_until(lambda: server.engine.next_round >= 2, 60, "round 1")
        enroll(server.config.enrolled_dir, impostor.public)
        status = AgentStatus(agent=POOL, state="idle", round=0, samples=100, version=1, updated_at=time.time(),
                             group_key_id=server.group_keys.key.key_id)  # fmt: skip
        server.mqtt.publish(server.topics.agent_status(POOL), signed_payload(status.to_dict(), impostor), retain=True)
        wait_until(lambda: f"enrolment refused agent={POOL}" in caplog.text, 10, "the refusal")
        reached, selections = server.engine.next_round, set()

        def two_more_rounds() -> bool:
            if (rs := server.engine.round_state) is not None:
                selections.add(tuple(rs.selected))
            return server.engine.next_round >= reached + 2

        wait_until(two_more_rounds, 60, "two more rounds")
    finally:
        stop.set()
        thread.join(15)
        fed.close()
    assert POOL not in server.registry.keyring and server.registry.status(POOL) is None
    assert selections and all(selected.count(POOL) == 1 for selected in selections), selections
    with pytest.raises(ConfigError, match="'server-pool' is the shared pool's name"):  # a restart says why
        load_server_config(fed.layout.server_config)
