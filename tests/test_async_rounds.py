"""Buffered asynchronous rounds (``rounds.mode = "async"``, FedBuff): a model version every K updates, late updates
folded with their staleness weight, refused as stale beyond ``max_staleness``, one update per agent per buffer,
joins bounded by ``max_concurrent``, the checkpoint, and differential privacy per released version."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from broker_server.config import async_problem, load_server_config
from broker_server.config_summary import server_summary
from broker_server.rounds.buffer_step import buffer_scale
from broker_server.rounds.engine import RoundEngine
from broker_server.rounds.round_task import late_rounds as late_rounds_of
from broker_server.watch.history import history_row
from broker_server.watch.monitor_text import metrics_line, server_line
from broker_server.watch.prometheus import ServerMetrics
from flcore.bounds import InfluencePolicy
from flcore.rounds import RoundRules
from flcore.staleness import Staleness
from flcore.update import NotForThisRound
from models.weights import RUNNING_STATISTICS, float_part
from protocol.buffer_text import buffer_text, wasted_text
from protocol.messages import RoundMetrics, ServerStatus
from protocol.prometheus import MetricsSection
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from sim.launch import format_round
from sim.report import write_report
from tests.fedharness import Federation, ServerHarness, override_toml, wait_until
from tests.fixtures import completed, dp_completed, random_delta
from tests.liveharness import SlowInRound, checkpointed_round, kill_9_and_restart, start_server_process

PLAIN = InfluencePolicy(clip="off", sample_multiple=0, change_multiple=0, collapse_ratio=0, screen_below=0)
AGENTS = ["agent-01", "agent-02", "agent-03"]


def async_engine(config, **rules) -> RoundEngine:
    table = {"mode": "async", "buffer": 2, "min_agents": 1, "quorum": 1, **rules}
    return RoundEngine(dataclasses.replace(config, strategy={"name": "fedavg"}, bounds=PLAIN,
                                           rounds=RoundRules(**table)), replay=ReplayGuard(3600))  # fmt: skip


def buffer_closes(engine: RoundEngine, agents: list[str], seed: int = 0, busy: frozenset[str] = frozenset()):
    """One buffer opened on the idle agents, filled by ``agents`` and closed; returns its metrics."""
    assert engine.begin_round(AGENTS, now=0.0, busy=set(busy)) is not None
    engine.announce(now=0.0)
    for i, agent in enumerate(agents):
        engine.accept(completed(engine, agent, seed=seed + i))
    assert engine.decide(now=0.5) == "close"
    return engine.close(now=1.0, model_wire_bytes=0)


def test_staleness_functions_are_the_papers_and_bad_specs_name_the_key():
    assert Staleness.parse("constant").weight(7) == 1.0
    assert Staleness.parse("polynomial:0.5").weight(3) == pytest.approx(0.5)  # (1 + 3)^-1/2
    hinge = Staleness.parse("hinge:1,2")
    assert [hinge.weight(s) for s in (0, 2, 4)] == [1.0, 1.0, pytest.approx(1 / 3)]  # 1 / (a (s - b) + 1)
    assert Staleness.fixed(0.7).weight(0) == 0.7 and str(Staleness.parse("hinge:1,2")) == "hinge:1,2"
    for bad in ("poly:1", "polynomial", "polynomial:-1", "hinge:1", "hinge:1,-1", "constant:2", 3):
        with pytest.raises(ValueError, match="rounds.staleness must be"):
            Staleness.parse(bad)
    with pytest.raises(ValueError, match='rounds.mode must be "sync"'):
        RoundRules(mode="later")
    with pytest.raises(ValueError, match="rounds.buffer must be a whole number >= 1"):
        RoundRules(mode="async", buffer=0)
    with pytest.raises(ValueError, match=r"rounds.server_lr must be a number in \(0, 10\]"):
        RoundRules(mode="async", server_lr=0)


def test_a_buffer_closes_at_k_and_a_late_update_joins_the_next_as_its_change_at_its_staleness_weight(config):
    engine = async_engine(config)
    assert engine.begin_round(AGENTS, now=0.0, busy=set()) is not None
    engine.announce(now=0.0)
    v1 = float_part(engine.global_arrays)
    late = completed(engine, "agent-03", seed=3, samples=300)  # trained from version 1 for round 1
    for i, agent in enumerate(["agent-01", "agent-02"]):
        engine.accept(completed(engine, agent, seed=i))
    assert engine.decide(now=0.1) == "close"  # K = 2, whoever is still training
    first = engine.close(now=1.0, model_wire_bytes=0)
    assert first.buffer == {"size": 2, "updates": 2, "late": 0, "staleness_mean": 0.0, "staleness_max": 0,
                            "staleness": {"0": 2}, "stale_refused": 0}  # fmt: skip
    assert engine.late.windows().owed() == ["agent-03"]
    v2 = float_part(engine.global_arrays)
    # agent-03 is still training: the next buffer opens on the others, and its update joins it
    assert engine.begin_round(AGENTS, now=1.0, busy={"agent-03"}).selected == ["agent-01", "agent-02"]
    engine.announce(now=1.0)
    record = engine.accept(late)
    assert (record.late_from, record.staleness) == (1, 1) and record.discount == pytest.approx(2**-0.5)
    stored = engine.state.store.updates.delta(engine.round_state.round, "agent-03@1")
    change = np.concatenate([random_delta(engine, 3)[k].ravel() for k in sorted(v1)])
    statistics = np.zeros(change.size, bool)
    offset = 0
    for k in sorted(v1):  # BatchNorm's running statistics join as its model's: v1 + delta - v2
        if k.endswith(RUNNING_STATISTICS):
            statistics[offset:offset + v1[k].size] = True
            change[offset:offset + v1[k].size] += (v1[k] - v2[k]).ravel()
        offset += v1[k].size
    np.testing.assert_allclose(stored, change, atol=1e-6)  # its change (FedBuff), not its model
    assert (~statistics).any() and statistics.any()
    with pytest.raises(NotForThisRound, match="duplicate"):  # a replay of it
        engine.accept(late)
    engine.accept(completed(engine, "agent-01", seed=11, samples=100))
    assert engine.decide(now=1.5) == "close"  # the late update counts towards K
    second = engine.close(now=2.0, model_wire_bytes=0)
    assert second.buffer["late"] == 1 and second.buffer["staleness"] == {"0": 1, "1": 1}
    assert second.aggregation["folded_late"] == ["agent-03@1"]
    assert second.aggregation["buffer_scale"] == pytest.approx((100 + 300 * 2**-0.5) / 400, abs=1e-6)
    assert engine.late.windows().owed() == ["agent-02"]  # agent-03's folded once: owed no more
    assert engine.begin_round(AGENTS, now=2.0, busy={"agent-01", "agent-02"}) is not None
    engine.announce(now=2.0)
    with pytest.raises(NotForThisRound, match="not-owed"):  # the same update again, in a later buffer
        engine.accept(late)


def test_server_lr_scales_the_buffers_step(config):
    other = dataclasses.replace(config, server=dataclasses.replace(config.server, state_dir="half"))
    plain, half = async_engine(config), async_engine(other, server_lr=0.5)
    before = plain.global_vector.copy()
    for engine in (plain, half):
        buffer_closes(engine, ["agent-01", "agent-02"])
    np.testing.assert_allclose(half.global_vector - before, 0.5 * (plain.global_vector - before), atol=1e-6)
    assert buffer_scale(2.0, np.array([1.0, 3.0]), np.array([1.0, 0.5])) == pytest.approx(2 * 2.5 / 4)


def test_an_update_beyond_max_staleness_is_refused_as_stale_and_counted(config):
    engine = async_engine(config, max_staleness=1)
    assert engine.begin_round(AGENTS, now=0.0, busy=set()) is not None
    engine.announce(now=0.0)
    old = completed(engine, "agent-03", seed=3)
    for i, agent in enumerate(["agent-01", "agent-02"]):
        engine.accept(completed(engine, agent, seed=i))
    engine.close(now=1.0, model_wire_bytes=0)
    buffer_closes(engine, ["agent-01", "agent-02"], seed=10, busy=frozenset({"agent-03"}))  # version 3 now
    assert engine.begin_round(AGENTS, now=2.0, busy={"agent-03"}) is not None
    engine.announce(now=2.0)
    with pytest.raises(NotForThisRound, match=r"stale: round 1's model is more than 1 versions behind the current 3 "
                                              r"\(rounds.max_staleness = 1\)") as refused:  # fmt: skip
        engine.accept(old)
    for reason in (refused.value.reason, "malformed: x", "bad-signature", "too-large", refused.value.reason):
        engine.reject("agent-03", reason)  # what the daemon's refusals do with a flood: counted once
    for i, agent in enumerate(["agent-01", "agent-02"]):
        engine.accept(completed(engine, agent, seed=20 + i))
    metrics = engine.close(now=3.0, model_wire_bytes=0)
    assert metrics.wasted == {"stale": 1} and metrics.buffer["stale_refused"] == 1
    assert not any(w.owed for w in engine.state.late)  # nobody owed: no older model kept for late updates
    kept = sorted(p.name for p in engine.state.store.directory.glob("global-v*.safetensors"))
    assert kept == ["global-v3.safetensors", "global-v4.safetensors"]  # the fallback and the model in force


def test_an_agent_owed_an_update_is_not_asked_again_until_its_status_answers_that_round(config):
    engine = async_engine(config)
    buffer_closes(engine, ["agent-01", "agent-02"])  # agent-03 selected in round 1, owed
    asked = engine.state.late[-1].asked_at
    assert engine.buffer.unsettled(lambda agent, window: False) == {"agent-03"}  # no status since it was asked
    assert engine.buffer.unsettled(lambda agent, window: window.asked_at == asked) == set()
    assert engine.begin_round(AGENTS, now=1.0, busy={"agent-03"}) is not None and late_rounds_of(engine) == 1
    engine.state.round_state.round = 5  # three buffers rolled back meanwhile: no version, but rounds went on
    assert late_rounds_of(engine) == 4  # its update of round 1 is still welcome
    engine.state.adopt(engine.global_arrays)  # a region takes its root's model: older updates fold in no more
    assert engine.state.late == ()


def first_buffer_without_agent_03(config) -> tuple[RoundEngine, object]:
    """Buffers of 3; the first closes on agent-01 and agent-02 (at its deadline, on the quorum) while agent-03 is
    still training it: returns the engine and agent-03's update of round 1, trained from version 1."""
    engine = async_engine(config, buffer=3)
    assert engine.begin_round(AGENTS, now=0.0, busy=set()) is not None
    engine.announce(now=0.0)
    late = completed(engine, "agent-03", seed=3)
    engine.accept(completed(engine, "agent-01", seed=1))
    engine.accept(completed(engine, "agent-02", seed=2))
    engine.close(now=1.0, model_wire_bytes=0)
    return engine, late


def test_a_second_update_of_one_agent_in_a_buffer_is_refused_and_counted_as_lost(config):
    engine, late = first_buffer_without_agent_03(config)
    assert engine.begin_round(AGENTS, now=1.0, busy=set()).selected == AGENTS  # its status lagged: asked again
    engine.announce(now=1.0)
    engine.accept(late)
    with pytest.raises(NotForThisRound, match="one-per-buffer") as refused:
        engine.accept(completed(engine, "agent-03", seed=4))
    engine.reject("agent-03", refused.value.reason)
    for i, agent in enumerate(["agent-01", "agent-02"]):
        engine.accept(completed(engine, agent, seed=5 + i))
    assert engine.close(now=2.0, model_wire_bytes=0).wasted == {"one-per-buffer": 1}


def test_a_buffer_opens_with_nobody_to_ask_when_late_updates_are_held_for_it(config):
    engine = async_engine(config)
    assert engine.begin_round(AGENTS, now=0.0, busy=set(AGENTS)) is None
    assert engine.begin_round(AGENTS, now=0.0, busy=set(AGENTS), held=True).selected == []


def test_joins_are_bounded_by_max_concurrent_and_one_update_per_agent_per_buffer(config):
    engine = async_engine(config, max_concurrent=2, buffer=3)
    # two statuses that claim training hold no room: the server asked neither (a rogue cannot block the others)
    assert engine.buffer.select(["agent-03"], busy={"agent-01", "agent-02"}, number=1) == ["agent-03"]
    rs = engine.begin_round(AGENTS, now=0.0, busy=set())
    assert len(rs.selected) == 2  # room for 2 training at once
    engine.announce(now=0.0)
    first, other = rs.selected
    third = next(a for a in AGENTS if a not in rs.selected)
    assert engine.buffer.join(AGENTS, busy={third}, now=1.0) == []  # training still (an older buffer's): no room
    engine.accept(completed(engine, first, seed=1))
    assert engine.buffer.join(AGENTS, busy=set(), now=2.0) == [third]  # room for one; the agent in the buffer waits
    assert engine.buffer.join(AGENTS, busy=set(), now=3.0) == [] and engine.round_state.asked_at == 2.0
    engine.accept(completed(engine, other, seed=2))
    assert engine.buffer.status() == {"size": 3, "filled": 2, "in_flight": 1}
    with pytest.raises(NotForThisRound, match="duplicate"):  # its own round's again
        engine.accept(completed(engine, first, seed=3))


def test_a_restart_mid_buffer_keeps_its_updates_and_the_older_models_late_ones_need(config):
    engine, late = first_buffer_without_agent_03(config)
    assert engine.begin_round(AGENTS, now=1.0, busy={"agent-03"}) is not None
    engine.announce(now=1.0)
    engine.accept(completed(engine, "agent-01", seed=4))
    again = async_engine(config, buffer=3)  # as after kill -9: only what the checkpoint holds
    assert [u.agent for u in again.round_state.updates] == ["agent-01"]
    assert again.accept(late).late_from == 1  # version 1 is still kept for it
    again.accept(completed(again, "agent-02", seed=5))
    assert again.close(now=2.0, model_wire_bytes=0).buffer["updates"] == 3


def test_async_refuses_what_a_buffer_cannot_do_at_start(config):
    rules = RoundRules(mode="async")
    assert async_problem(dataclasses.replace(config, rounds=rules)) == ""
    assert " mode=async buffer=10 staleness=polynomial:0.5 max_staleness=10 max_concurrent=all server_lr=1" in \
        server_summary(dataclasses.replace(config, rounds=rules))  # skyfed server check  # fmt: skip
    for strategy, why in (({"name": "fedamp"}, "gives agents models of their own"),
                          ({"name": "fedavg", "threshold": 2}, "strategy.threshold")):  # fmt: skip
        assert why in async_problem(dataclasses.replace(config, rounds=rules, strategy=strategy))


def test_private_async_rounds_report_epsilon_per_version_and_stop_at_the_budget(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=10, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"mode": "async", "buffer": 3, "min_agents": 3, "quorum": 3,
                                                "staleness": "polynomial:0.5"},
                  strategy={"name": "fedavg", "weighting": "uniform"},
                  privacy={"clip": 0.5, "noise_multiplier": 2.0, "target_epsilon": 3.5})  # fmt: skip
    with pytest.raises(Exception, match='rounds.staleness = "constant"'):
        load_server_config(layout.server_config)
    override_toml(layout.server_config, rounds={"staleness": "constant"})
    config = load_server_config(layout.server_config)
    engine = RoundEngine(config, replay=ReplayGuard(3600), evaluator=lambda arrays: {"accuracy": 0.5})
    epsilons, versions = [], []
    while engine.begin_round(AGENTS, now=0.0, enrolled=AGENTS, busy=set()) is not None:
        engine.announce(now=0.0)
        for i, agent in enumerate(AGENTS):
            engine.accept(dp_completed(engine, agent, seed=i), now=1.0)
        metrics = engine.close(now=1.0, model_wire_bytes=0)
        epsilons.append(metrics.privacy["epsilon"])
        versions.append(metrics.model_version)
    assert versions == [2, 3] and epsilons[0] < epsilons[1] <= 4.1  # one charge per released version, then stop
    assert engine.finished and engine.budget_exhausted


# --- over the real broker, the real daemons
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_an_async_federation_survives_kill_9_mid_buffer_with_every_accepted_update_accounted_for(tmp_path, broker):
    """Buffers of 2 from 3 agents, agent-01 slow in round 1 (its update lands in a later buffer, late); the server
    is killed once a buffer holds an update, restarted, and the run ends with every update it accepted in the
    metrics, the late one folded with its staleness and nothing refused for its age."""
    fed = Federation(tmp_path, broker, rounds=10, asynchronous=True, buffer=2)
    slow = fed.agents[0]  # late by several buffers of the other two (0.1-1 s each), fewer than the 9 after round 1
    slow.runner.trainer = SlowInRound(slow.runner.trainer, round_number=1, until=lambda: len(fed.metrics()) >= 4)
    log = tmp_path / "server.log"
    server = start_server_process(fed.layout.server_config, log)
    fed.start_agents()

    def mid_buffer() -> tuple[int, list[str]] | None:
        number, accepted = checkpointed_round(fed.server_state)
        return (number, accepted) if number >= 2 and accepted else None

    try:
        killed_in, before_kill = wait_until(mid_buffer, 120, "an update in the buffer of round 2 or later")
        server = kill_9_and_restart(server, fed.layout.server_config, log)
        assert server.wait(200) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
        fed.close()
    metrics = fed.metrics()
    assert [m.round for m in metrics] == list(range(1, 11)) and all(m.outcome == "committed" for m in metrics)
    resumed = next(m for m in metrics if m.round == killed_in)
    assert set(before_kill) <= set(resumed.accepted) | set(resumed.aggregation.get("folded_late", []))
    for m in metrics:  # every accepted update is in its buffer's count
        assert m.buffer["updates"] == len(m.accepted) + len(m.aggregation.get("folded_late", [])) >= 2, m
    late = [k for m in metrics for k in m.aggregation.get("folded_late", [])]
    behind = {a.id for a in fed.agents} - set(metrics[0].accepted)  # agent-01 unless the others' start was slower
    assert len(behind) == 1 and f"{behind.pop()}@1" in late and not any(m.wasted for m in metrics)
    assert any(m.buffer["staleness_max"] >= 1 for m in metrics)
    assert "server resumed" in log.read_text()


# --- every surface says versions, buffer fill, staleness and what was lost
def buffer_metrics_row(round_number: int, updates: int, late: int, stale: int) -> RoundMetrics:
    return RoundMetrics(round=round_number, strategy="fedavg", participants=["agent-01", "agent-02"],
                        accepted=["agent-01"], rejected=[], duration_s=1.0, aggregate_s=0.0, bytes_up=1, bytes_down=1,
                        eval={"accuracy": 0.5, "loss": 1.0}, model_version=round_number + 1, finished_at=0.0,
                        aggregation={"folded_late": [f"agent-02@{round_number - 1}"] * late},
                        wasted={"stale": stale} if stale else {},
                        buffer={"size": 2, "updates": updates, "late": late, "staleness_mean": 0.5,
                                "staleness_max": 1, "staleness": {"0": updates - late, "1": late},
                                "stale_refused": stale})  # fmt: skip


def test_status_monitor_prometheus_and_history_show_the_buffer_and_the_staleness():
    status = ServerStatus(state="running", federation="f", round=3, phase="training", strategy="fedavg",
                          model_version=4, agents_online=5, updated_at=0.0,
                          buffer={"size": 5, "filled": 2, "in_flight": 3})  # fmt: skip
    assert "buffer=2/5 in_flight=3" in server_line(status) and "model=v4" in server_line(status)
    m = buffer_metrics_row(3, 2, 1, 1)
    line = metrics_line(m)
    assert "version=4 staleness_mean=0.5 staleness_max=1 lost_stale=1" in line
    assert buffer_text(m.buffer) == "buffer 2/2, 1 late, staleness 0.5 (max 1)" and wasted_text(m.wasted) == \
        "lost 1 stale"  # the sim's console, the monitor's rounds table  # fmt: skip
    assert "buffer 2/2" in format_round(m, 10.0) and "lost 1 stale" in format_round(m, 10.0)
    row = history_row(m)
    assert row["staleness"] == 0.5 and row["lost"] == 1  # the dashboard's rows
    assert "staleness" not in history_row(dataclasses.replace(m, buffer={}, wasted={}))
    prometheus = ServerMetrics(MetricsSection())
    value = prometheus.registry.get_sample_value
    prometheus.status(status, participants=4)
    assert (value("skyfed_server_buffer_filled"), value("skyfed_server_buffer_size"),
            value("skyfed_server_agents_in_flight"), value("skyfed_server_model_version")) == (2, 5, 3, 4)
    prometheus.round_closed(m)
    assert value("skyfed_server_update_staleness_count") == 2 and value("skyfed_server_update_staleness_sum") == 1
    assert value("skyfed_server_updates_wasted_total", {"kind": "stale"}) == 1


def test_report_draws_the_buffers_of_an_async_run(tmp_path):
    rows = [json.loads(buffer_metrics_row(r, 2, r % 2, r // 3).to_json()) for r in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = write_report(tmp_path, echo=lambda _line: None)
    assert tmp_path / "buffer.png" in written and (tmp_path / "buffer.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flags, message", [
    ({"buffer": 5}, "--buffer needs --async"),
    ({"asynchronous": True, "buffer": 9}, "--buffer 9 is more than the 4 agents"),
    ({"asynchronous": True, "staleness": "poly:2"}, "--staleness must be"),
    ({"asynchronous": True, "mode": "peer"}, "--async is not available with --mode peer"),
    ({"asynchronous": True, "in_process": True}, "--async is not available with --in-process"),
    ({"asynchronous": True, "regions": 2}, "--async is not available with --regions"),
])  # fmt: skip
def test_sim_refuses_a_buffer_it_cannot_run_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        SimSettings(agents=4, **flags)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_over_the_broker_a_replayed_late_update_is_refused_as_a_replay_and_a_stale_one_as_stale(tmp_path, broker):
    """Agents played by the test: agent-03's update of round 1 lands in round 2's buffer (late, staleness 1); the
    same chunks again are a replay, a new transfer of it a duplicate; agent-02's update of round 2, sent once two
    more versions are out (rounds.max_staleness = 1), is refused as stale and counted."""
    rules = {"mode": "async", "buffer": 2, "max_staleness": 1, "quorum": 1, "min_agents": 1}
    with ServerHarness(tmp_path, broker, agents=3, rounds=5, round_rules=rules) as h:
        h.announce_agents()
        wait_until(lambda: h.tasks and sorted(h.tasks[-1].selected) == AGENTS, what="round 1 asking all three")
        late = h.sealed(h.agents["agent-03"], h.update_bytes(h.random_delta(3)))  # trained from version 1
        for i, agent in enumerate(["agent-01", "agent-02"]):
            h.send(agent, h.random_delta(i))
        wait_until(lambda: h.tasks[-1].round == 2, what="round 2")
        assert sorted(h.tasks[-1].selected) == ["agent-01", "agent-02"] and "agent-03" in h.tasks[-1].late
        stale = h.update_bytes(h.random_delta(9), round_number=2)  # agent-02's, trained from version 2
        h.publish_update("agent-03", late)
        h.publish_update("agent-03", late)  # the same chunks again
        h.wait_rejection("replay")
        h.publish_update("agent-03", h.sealed(h.agents["agent-03"], h.update_bytes(h.random_delta(3))))
        h.wait_rejection("duplicate")
        h.send("agent-01", h.random_delta(4), round_number=2)
        for number in (3, 4):  # two more versions without agent-02
            wait_until(lambda n=number: h.tasks[-1].round == n, what=f"round {number}")
            for agent in h.tasks[-1].selected:
                h.send(agent, h.random_delta(10 + number), round_number=number)
        wait_until(lambda: h.tasks[-1].round == 5, what="round 5")
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], stale, round_number=2))
        h.wait_rejection("stale")
        for agent in h.tasks[-1].selected:
            h.send(agent, h.random_delta(20), round_number=5)
        metrics = h.wait_metrics(5)
    second = h.metrics[1]
    assert second.aggregation["folded_late"] == ["agent-03@1"] and second.buffer["staleness"] == {"0": 1, "1": 1}
    assert {"replay", "duplicate"} <= {r.reason.split(":")[0] for r in second.rejected}
    assert metrics.wasted == {"stale": 1} and metrics.buffer["stale_refused"] == 1
    assert [m.model_version for m in h.metrics] == [2, 3, 4, 5, 6]
