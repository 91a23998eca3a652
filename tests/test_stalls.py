"""One agent that never delivers — broken, or switched off with a forged "ready" status — cannot stall
a federation: at the deadline an idle eligible agent stands in, and the absent one is backed off."""

from __future__ import annotations

import threading
import time

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from broker_server.health import HealthBook
from broker_server.rounds import RoundRules, RoundState, UpdateRecord, decide, replace_missing
from protocol.messages import AgentStatus
from protocol.mqtt import BrokerSettings, MqttClient
from tests.fedharness import Federation, override_toml, wait_until


class ForgedStatus:
    """Someone with publish rights on ``agent/agent-03/status`` keeps a switched-off agent looking ready."""

    def __init__(self, broker, server: Aggregator) -> None:  # noqa: ANN001
        self.client = MqttClient("forger", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
        assert self.client.start(timeout_s=5)
        self.server, self.stop = server, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            status = AgentStatus(
                agent="agent-03", state="idle", round=0, samples=400, version=1, updated_at=time.time(),
                group_key_id=self.server.group_keys.key.key_id,  # read off any real agent's status
            )  # fmt: skip
            self.client.publish("skyfed/it/agent/agent-03/status", status.to_json(), retain=True)
            self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.client.stop()


def test_a_switched_off_agent_with_a_forged_ready_status_is_replaced_and_backed_off(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=3, agents=3)
    override_toml(fed.layout.server_config, rounds={"fraction": 0.5, "min_agents": 2, "quorum": 2, "deadline_s": 4.0})
    server = Aggregator(load_server_config(fed.layout.server_config))
    server_thread = threading.Thread(target=server.run, daemon=True)
    server_thread.start()
    forger = ForgedStatus(broker, server)
    try:
        fed.threads[0].start()  # agent-01 and the ghost make the two a round needs: the ghost is selected
        wait_until(lambda: server.engine.round_state is not None, 30, "round 1 to start")
        assert server.engine.round_state.selected == ["agent-01", "agent-03"]
        fed.threads[1].start()  # agent-02 comes online, idle, during round 1
        server_thread.join(90)
        assert not server_thread.is_alive(), "the federation stalled on the absent agent"
    finally:
        forger.close()
        fed.close()
    first, *later = fed.metrics()
    assert first.missed == ["agent-03"] and sorted(first.accepted) == ["agent-01", "agent-02"]
    assert "agent-03" not in later[0].participants  # backed off for the round after its miss
    assert [m.round for m in later] == [2, 3] and all(len(m.accepted) >= 2 for m in later)
    assert server.engine.health.records["agent-03"].misses >= 1
    assert "agent-01" not in server.engine.health.records


def test_stand_ins_replace_the_pending_agents_and_a_late_update_is_still_welcome():
    state = RoundState(round=4, attempt=1, selected=["a", "ghost"], deadline=10.0, started_at=0.0)
    state.updates.append(UpdateRecord(agent="a", samples=100, loss=0.1, norm=1.0, wire_bytes=10))
    assert decide(state, RoundRules(min_agents=2, quorum=2), now=11.0) == "reannounce"
    excused, stand_ins = replace_missing(state, ["a", "b", "ghost"], seed=1)
    assert (excused, stand_ins) == (["ghost"], ["b"]) and state.pending == ["b"] and "ghost" in state.selected
    nobody = RoundState(round=4, attempt=1, selected=["a", "ghost"], deadline=10.0, started_at=0.0)
    assert replace_missing(nobody, ["a", "ghost"], seed=1) == ([], []) and nobody.pending == ["a", "ghost"]


def test_back_off_doubles_per_consecutive_miss_is_capped_and_cleared_by_a_delivery():
    book = HealthBook()
    assert [book.missed("x", 10).backed_off_until for _ in range(3)] == [11, 12, 14]
    assert book.available(["x", "y"], 14) == ["y"] and book.available(["x", "y"], 15) == ["x", "y"]
    assert book.backed_off(13) == {"x": 3}
    for _ in range(20):
        book.missed("x", 10)
    assert book.records["x"].backed_off_until == 10 + 32
    book.delivered("x")
    assert book.available(["x"], 11) == ["x"] and HealthBook.from_dict(book.to_dict()).records == {}
