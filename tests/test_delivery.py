"""Agents that never deliver cost a round its deadline once, not every round, and
the refusals that say an agent sent nothing usable end its part in the round at once."""

from __future__ import annotations

import hashlib
import logging
import re
import socket
import time

import pytest

from broker_server.agents.model_resend import MAX_RESENDS_PER_WINDOW, MODEL_STALL_S, ModelWaits, RetainedModel
from broker_server.agents.registry import AgentRegistry, StatusRefused
from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from broker_server.rounds.engine import RoundEngine
from flcore.update import UpdateMeta, UpdateMetaError
from protocol.messages import AgentStatus
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.transfer import Reassembler
from security.envelope import Opener
from security.keys import Identity, Keyring
from security.replay import ReplayGuard
from security.signing import signed_payload
from sim.federation import SimSettings, create_federation
from tests.fedharness import Federation, ServerHarness, hosted_agent, override_toml, wait_until
from tests.fixtures import completed
from tests.liveharness import metrics_rows, signed_task, skyfed

AGENTS = ["agent-01", "agent-02", "agent-03"]


@pytest.fixture
def config(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=6, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 2, "quorum": 2, "deadline_s": 20.0})
    return load_server_config(layout.server_config)


def test_an_agent_pending_when_a_quorate_round_closes_at_its_deadline_is_backed_off_across_a_restart(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    assert engine.round_state.selected == AGENTS
    for i, agent in enumerate(AGENTS[:2]):
        engine.accept(completed(engine, agent, seed=i), now=1.0)
    assert engine.decide(now=5.0) == "wait" and engine.decide(now=21.0) == "close"  # it waits for agent-03 once
    engine.close(now=21.0, model_wire_bytes=0)
    restarted = RoundEngine(config, replay=ReplayGuard(3600))  # the back-off is in the checkpoint
    assert restarted.health.backed_off(2, now=30.0) == {"agent-03": 1}
    assert restarted.begin_round(AGENTS, now=30.0).selected == AGENTS[:2]
    restarted.announce(now=30.0)
    for i, agent in enumerate(AGENTS[:2]):
        restarted.accept(completed(restarted, agent, seed=i), now=31.0)
    restarted.close(now=31.0, model_wire_bytes=0)  # a quick round: the round back-off is over, the time one not
    assert RoundEngine(config, replay=ReplayGuard(3600)).begin_round(AGENTS, now=32.0).selected == AGENTS[:2]


def test_a_backed_off_agent_needed_to_make_up_min_agents_is_on_probation_and_not_waited_for(config, tmp_path):
    override_toml(config.path, rounds={"min_agents": 3})  # every agent, as skyfed sim sets it
    engine = RoundEngine(load_server_config(config.path), replay=ReplayGuard(3600))
    for number, now in ((1, 0.0), (2, 100.0)):
        engine.begin_round(AGENTS, now=now)
        engine.announce(now=now)
        assert engine.round_state.selected == AGENTS
        for i, agent in enumerate(AGENTS[:2]):
            engine.accept(completed(engine, agent, seed=i), now=now + 1)
        expected = "wait" if number == 1 else "close"  # round 2 does not wait for the silent agent
        assert engine.decide(now=now + 1) == expected and engine.round_state.probation == AGENTS[2:] * (number - 1)
        engine.close(now=now + (20.0 if number == 1 else 1.0), model_wire_bytes=0)
    assert engine.health.records["agent-03"].misses == 1  # not waited for on probation: no second miss


def two_of_three_delivered(config) -> RoundEngine:  # noqa: ANN001
    """Round 1 open, with agent-01 and agent-02's updates accepted and agent-03 still pending."""
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(AGENTS[:2]):
        engine.accept(completed(engine, agent, seed=i), now=1.0)
    return engine


def test_a_round_closed_early_by_a_threshold_backs_off_nobody(config):
    engine = two_of_three_delivered(config)
    engine.close(now=2.0, model_wire_bytes=0)  # before the deadline: agent-03 was slower, not absent
    assert engine.health.records == {}


def test_an_agent_that_says_its_training_failed_is_not_waited_for_and_is_backed_off(config):
    engine = two_of_three_delivered(config)
    assert not engine.fleet.gave_up("agent-03", 7, "reported its training failed", 2.0)  # another round's status
    assert engine.fleet.gave_up("agent-03", 1, "reported its training failed", 2.0)
    assert not engine.fleet.gave_up("agent-03", 1, "reported its training failed", 2.0)  # counted once
    assert engine.decide(now=2.0) == "close"  # at once, not at the deadline
    metrics = engine.close(now=2.0, model_wire_bytes=0)
    assert metrics.missed == ["agent-03"] and engine.health.backed_off(2, now=2.0) == {"agent-03": 1}


def test_a_deeply_nested_local_eval_is_a_bad_header_not_a_crash():
    meta = UpdateMeta(round=1, base_version=1, samples=10, loss=0.5).to_metadata()
    for depth, why in ((5000, "exceed the limit"), (2000, "nested too deeply")):  # 5000: as first measured
        meta["local_eval"] = "[" * depth + "]" * depth
        with pytest.raises(UpdateMetaError, match=f"bad-metadata: .*{why}"):
            UpdateMeta.from_metadata(meta)


@pytest.mark.parametrize("refused", ["too-large", "from-the-future"])
def test_an_update_refused_whole_ends_its_senders_part_in_the_round_at_once(tmp_path, broker, refused):
    """Too large, or signed on a clock 600 s ahead (the server's own clock decides; before, each round waited
    its deadline for an agent whose every update was refused so)."""
    with ServerHarness(tmp_path, broker, agents=3, round_rules={"quorum": 2, "min_agents": 2}) as h:
        h.announce_agents()
        for agent in ("agent-01", "agent-02"):
            h.publish_update(agent, h.sealed(h.agents[agent], h.update_bytes(h.random_delta(int(agent[-1])))))
        if refused == "too-large":
            h.publish_update("agent-03", h.sealed(h.agents["agent-03"], bytes(64 << 20))[:1])
        else:
            h.publish_update("agent-03", h.sealed(h.agents["agent-03"], h.update_bytes(h.random_delta(3)), age_s=-600))
        metrics = h.wait_metrics()  # within seconds: the deadline is 30 s away
    assert sorted(metrics.accepted) == ["agent-01", "agent-02"] and metrics.missed == ["agent-03"]
    assert any(r.reason.startswith(refused) for r in metrics.rejected)


def _status(agent: Identity, t: float, state: str = "idle", session: float = 0.0) -> bytes:
    status = AgentStatus(agent=agent.name, state=state, round=0, samples=9, version=1, updated_at=t,
                         group_key_id="k", session=session)  # fmt: skip
    return signed_payload(status.to_dict(), agent)


def test_an_offline_will_from_an_earlier_connection_replayed_after_each_real_status_is_refused():
    agent = Identity.generate("drone-01")
    registry = AgentRegistry(Keyring([agent.public]), status_timeout_s=60)
    old_will = signed_payload(AgentStatus.offline("drone-01", session=100.0).to_dict(), agent)  # captured earlier
    registry.update("drone-01", _status(agent, 101.0, session=100.0), now=101.0)
    registry.update("drone-01", old_will, now=102.0)  # that connection's own will: it went offline
    assert registry.eligible("k", now=102.0) == []
    for t in (200.0, 210.0, 220.0):  # a new connection (session 200); the old will replayed after each status
        registry.update("drone-01", _status(agent, t + 1, session=200.0), now=t + 1)
        with pytest.raises(StatusRefused, match="status-stale-will"):
            registry.update("drone-01", old_will, now=t + 2)
        assert registry.eligible("k", now=t + 2) == ["drone-01"]
    new_will = signed_payload(AgentStatus.offline("drone-01", session=200.0).to_dict(), agent)
    registry.update("drone-01", new_will, now=230.0)  # the current connection's will still counts
    assert registry.eligible("k", now=230.0) == []


def test_a_switched_off_agents_retained_ready_status_is_dated_by_its_signature_after_a_server_restart():
    agent = Identity.generate("drone-01")
    registry = AgentRegistry(Keyring([agent.public]), status_timeout_s=60)  # a server that just started
    registry.update("drone-01", _status(agent, 1000.0), now=5000.0)  # signed over an hour ago, retained since
    assert registry.eligible("k", now=5000.0) == []
    registry.update("drone-01", _status(agent, 5001.0), now=5001.0)  # alive after all: its next status counts
    assert registry.eligible("k", now=5001.0) == ["drone-01"]


def test_the_server_measures_an_agents_clock_on_its_live_signed_statuses():
    agent = Identity.generate("drone-01")
    registry = AgentRegistry(Keyring([agent.public]), status_timeout_s=60)
    registry.update("drone-01", _status(agent, 700.0), now=100.0)  # first sight (maybe retained): not measured
    registry.update("drone-01", _status(agent, 710.0), now=110.0)
    assert registry.clock_offsets() == {"drone-01": 600.0}
    for t in range(720, 800, 10):  # its clock was fixed: gone once the last 8 statuses agree
        assert registry.clock_offsets() == {"drone-01": 600.0}
        registry.update("drone-01", _status(agent, t + 1.0), now=float(t))
    assert registry.clock_offsets() == {}


def test_an_agent_whose_clock_runs_600_s_ahead_says_clock_skew_and_keeps_to_the_servers_time(tmp_path, caplog):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    server = Identity.load(layout.server_config.parent / "server.key")
    agent = hosted_agent(layout.agent_configs["agent-01"])
    server_now = time.time() - 600  # the server's clock, as seen by an agent running 600 s ahead
    caplog.set_level(logging.INFO, logger="skyfed.agent")
    agent._on_task(signed_task(server, round=1, issued_at=server_now - 2, expires_at=server_now + 60))
    assert agent.task is None and "clock" in agent.detail  # one task alone: an old one, or a skewed clock?
    agent._on_task(signed_task(server, round=2, issued_at=server_now, expires_at=server_now + 60))
    assert agent.task is not None and agent.task.round == 2  # two agree: judged on the server's time
    assert not agent.task.expired(agent.server_time())
    assert "clock skew offset_s=+600" in caplog.text
    status = agent.report.status()
    assert 599 < status.clock_offset_s < 601 and "clock skew" in status.detail


def test_a_waiting_agent_gets_the_model_at_a_bounded_rate_per_agent_and_overall():
    waits = ModelWaits()
    waits.note("a", True, now=0.0)
    assert waits.due(MODEL_STALL_S - 1, ["a"]) == [] and waits.due(MODEL_STALL_S, ["a"]) == ["a"]
    assert waits.due(MODEL_STALL_S * 2, ["a"]) == [] and waits.due(MODEL_STALL_S * 3, ["a"]) == ["a"]  # doubled
    assert waits.due(MODEL_STALL_S * 9, []) == [] and not waits.since  # no longer pending: forgotten
    many = ModelWaits()
    names = [f"x{i}" for i in range(10)]
    for name in names:
        many.note(name, True, now=0.0)
    assert len(many.due(100.0, names)) == MAX_RESENDS_PER_WINDOW  # all agents together
    many.note("x0", False, now=100.0)  # it got the model: forgotten
    assert "x0" not in many.since


def test_the_retained_model_counts_as_damaged_only_when_read_back_empty_or_different():
    retained = RetainedModel()
    retained.published(3, [bytearray(b"one"), bytearray(b"two")])
    retained.observe(3, "0", b"one")
    retained.observe(2, "0", b"")  # the previous version cleared: expected
    assert not retained.damaged
    retained.observe(3, "1", b"")
    assert retained.damaged == {1}
    retained.observe(3, "1", b"two")  # put back
    assert not retained.damaged


def test_an_agent_that_keeps_saying_waiting_model_gets_it_on_its_inbox_and_nobody_else_gets_it_again(
    tmp_path, broker, monkeypatch
):
    from broker_server.agents import model_resend

    monkeypatch.setattr(model_resend, "MODEL_STALL_S", 0.5)
    with ServerHarness(tmp_path, broker) as h:
        task = h.announce_agents()
        watcher = MqttClient("watcher", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
        watcher.subscribe("skyfed/t/model/+/+")
        watcher.subscribe("skyfed/t/agent/agent-01/inbox")
        assert watcher.start(timeout_s=5)
        agent = h.agents["agent-01"]
        opener = Opener(identity=agent, federation="t", senders=Keyring([h.server.identity.public]))
        reassembler, models, republished = Reassembler(opener), [], 0
        try:
            end = time.monotonic() + 4.0
            while time.monotonic() < end:  # the agent says it waits, every 0.2 s, for 4 s
                status = AgentStatus(agent="agent-01", state="waiting-model", round=1, samples=100, version=0,
                                     updated_at=time.time(), group_key_id=h.server.group_keys.key.key_id)  # fmt: skip
                signed = signed_payload(status.to_dict(), agent)
                h.driver.publish(h.topics.agent_status("agent-01"), signed, retain=True)
                while (message := watcher.poll(0.2)) is not None:
                    topic, payload = message
                    if topic.endswith("/inbox"):
                        done = reassembler.feed(payload, topic_sender="server", kinds=frozenset({"model"}))
                        models += [done] if done is not None else []
                    elif time.monotonic() > end - 3.5:  # after the retained copy every subscriber gets at once
                        republished += 1
        finally:
            watcher.stop()
    assert republished == 0  # one waiting agent no longer makes the server re-publish the model to everyone
    assert 1 <= len(models) <= 3  # after 0.5 s, then 1 s, 2 s later: bounded, doubling
    assert hashlib.sha256(models[0].data).hexdigest() == task.model_sha256 and models[0].manifest.round == 1


def test_skyfed_sim_with_a_silent_agent_no_longer_waits_the_deadline_every_round(tmp_path, broker):
    """``--attack silent``: an agent that trains, says ``done`` and never sends. On main every round waited
    the deadline for it; now the first miss backs it off and the next rounds close without it."""
    out, deadline = tmp_path / "silent", 8.0
    result = skyfed(
        "sim", "--agents", "4", "--rounds", "4", "--attackers", "1", "--attack", "silent", "--deadline",
        str(deadline), "--partition", "iid", "--out", str(out), "--broker", broker.address, "--federation", "silent",
        "--agents-per-process", "4",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = metrics_rows(out)
    silent = rows[0]["attackers"]
    assert len(silent) == 1 and all(silent[0] not in r["accepted"] for r in rows)
    waited = [r["round"] for r in rows if r["duration_s"] >= deadline]
    assert waited[0] == 1 and rows[1]["duration_s"] < deadline, [r["duration_s"] for r in rows]
    assert len(waited) <= 2  # back-off 1, 2, 4 … rounds: after round 1 only round 3 asks it again


def test_each_connection_has_its_own_signed_will_so_an_earlier_one_replayed_is_refused(tmp_path, broker):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), (broker.host, broker.port))
    agent = hosted_agent(layout.agent_configs["agent-01"])
    registry = AgentRegistry(Keyring([agent.identity.public]), status_timeout_s=60)
    watcher = MqttClient("watcher", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
    watcher.subscribe("skyfed/it/agent/agent-01/status")
    assert watcher.start(timeout_s=5) and agent.edge.mqtt.start(timeout_s=5)
    try:
        first = wait_until(lambda: agent.edge.session, what="the first connection")
        agent.report.publish(force=True)
        wait_until(lambda: registry_fed(watcher, registry) not in ("", "offline"), what="the first status")
        agent.edge.mqtt._client.socket().shutdown(socket.SHUT_RDWR)  # the link drops: the broker publishes the will
        wait_until(lambda: registry_fed(watcher, registry) == "offline", what="the first connection's will")
        will = registry.seen["agent-01"].status
        assert will.session == will.updated_at == first
        wait_until(lambda: agent.edge.session > first, what="a reconnection, with a new will")
        agent.report.publish(force=True)
        wait_until(lambda: registry_fed(watcher, registry) not in ("", "offline"), what="a new connection's status")
        replayed = signed_payload(will.to_dict(), agent.identity)  # as captured off the broker
        with pytest.raises(StatusRefused, match="status-stale-will"):
            registry.update("agent-01", replayed, now=time.time())
    finally:
        agent.edge.mqtt.stop(2)
        watcher.stop()


def registry_fed(watcher: MqttClient, registry: AgentRegistry) -> str:
    """Feed what the watcher received to ``registry``; the state it holds for agent-01 now."""
    while (message := watcher.poll(0.05)) is not None:
        if message[1]:
            registry.update("agent-01", message[1], now=time.time())
    seen = registry.seen.get("agent-01")
    return seen.status.state if seen else ""


class _ClockAhead:
    """The ``time`` module as the agents' code sees it on devices whose clocks run ``offset`` seconds ahead."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def time(self) -> float:
        return time.time() + self.offset

    def __getattr__(self, name: str):  # noqa: ANN204 - monotonic, perf_counter, sleep: the real ones
        return getattr(time, name)


def test_agents_whose_clocks_run_600_s_ahead_train_on_the_servers_time_and_both_sides_say_clock_skew(
    tmp_path, broker, monkeypatch, caplog
):
    import agent.daemon
    import agent.status_report
    import participant.upload
    from security import envelope

    ahead = _ClockAhead(600.0)
    for module in (agent.daemon, agent.status_report):  # task times, and the times its statuses say
        monkeypatch.setattr(module, "time", ahead)

    def seal_ahead(*args, now=None, **kwargs):  # noqa: ANN002, ANN003, ANN202 - its uploads, signed on its clock
        return envelope.seal(*args, now=ahead.time() if now is None else now, **kwargs)

    monkeypatch.setattr(participant.upload, "seal", seal_ahead)
    caplog.set_level(logging.INFO)
    fed = Federation(tmp_path, broker, rounds=2, agents=2)
    override_toml(fed.layout.server_config, rounds={"deadline_s": 15.0})  # expired on a clock 600 s ahead
    fed.run(Aggregator(load_server_config(fed.layout.server_config)), timeout_s=60)  # on main: every task expired
    assert [len(m.accepted) for m in fed.metrics()] == [2, 2]  # before: every update refused from-the-future
    assert not any(m.rejected for m in fed.metrics())
    assert re.search(r"clock skew agent=agent-01 offset_s=\+(599|600)\.", caplog.text)  # the server: signed statuses
    assert re.search(r"clock skew offset_s=\+(599|600)\.", caplog.text)  # the agents: signed task times
