"""Availability traces: a sim's fleet that comes and goes, through each agent's own gate."""

import re
import time

import pytest

from agent.config import ConfigError, load_agent_config
from agent.telemetry import GatePolicy, Telemetry, TelemetrySection
from agent.telemetry.availability import Availability, Flights, parse_availability, parse_duration
from sim import run as sim_run
from sim.availability import round_sizes
from sim.federation import SimSettings, create_federation
from sim.settings import agent_names
from tests.liveharness import metrics_rows


def write_csv(path, rows, header="agent,start_s,end_s"):
    path.write_text(header + "\n" + "".join(f"{a},{s},{e}\n" for a, s, e in rows))
    return str(path)


def scan(trace, agent, horizon_s, step_s=1.0):
    """The trace's state every ``step_s`` seconds: a list of booleans."""
    timeline = trace.timeline(agent)
    return [timeline.state(k * step_s)[0] for k in range(int(horizon_s / step_s))]


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("4m", 240), ("1.5h", 5400)])
def test_durations_take_s_m_or_h(text, seconds):
    assert parse_duration(text) == seconds


def test_flights_keep_their_share_online_with_a_phase_of_each_agents_own():
    trace = parse_availability("flights:on=5m,off=15m,jitter=1m")
    assert trace == Flights(300, 900, 60)
    states = {a: scan(trace, a, 40 * 3600, 5.0) for a in agent_names(6)}
    for agent, seen in states.items():
        assert 0.22 < sum(seen) / len(seen) < 0.28, agent  # 25 % online over 40 hours
    assert len({tuple(seen) for seen in states.values()}) == 6  # each agent flies at its own times
    again = parse_availability("flights:on=5m,off=15m,jitter=1m")
    assert scan(trace, "agent-01", 3600) == scan(again, "agent-01", 3600)  # the same fleet in every run


def test_every_period_stays_within_its_jitter_and_the_time_left_is_exact():
    trace = Flights(300, 900, 60)
    timeline = trace.timeline("agent-07")
    t = 0.0
    while t < 20 * 3600:
        online, left = timeline.state(t)
        assert 0 < left <= (360 if online else 960)
        assert timeline.state(t + left - 0.01)[0] == online
        assert timeline.state(t + left + 0.01)[0] != online
        t += left + 0.01
    for start, end in zip(timeline.starts, timeline.ends, strict=True):
        assert 240 <= end - start <= 360


def test_a_csv_trace_merges_overlaps_repeats_after_its_last_end_and_says_when_an_agent_is_back(tmp_path):
    path = write_csv(tmp_path / "trace.csv", [("agent-01", 10, 20), ("agent-01", 15, 30), ("agent-02", 50, 100)])
    trace = parse_availability(path)
    assert trace.rows["agent-01"] == ((10.0, 30.0),) and trace.period_s == 100
    assert trace.online_fraction(["agent-01", "agent-02"]) == pytest.approx(0.35)
    away = Availability(trace, "agent-01", origin=1000.0)
    assert away.reason(1000.0 + 5) == "away: the availability trace has this agent offline (back in 5s)"
    assert away.reason(1000.0 + 25) == ""
    assert away.reason(1000.0 + 100 + 12) == ""  # the second pass of the trace
    assert "back in 1m20s" in away.reason(1000.0 + 30)  # until 110: the next pass's first interval


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("flights:on=4m", "flights needs on= and off="),
        ("flights:on=4m,off=20m,every=3m", "flights takes on=, off= and jitter="),
        ("flights:on=4x,off=20m", "'4x' is not a duration"),
        ("flights:on=1m,off=20m,jitter=1m", "jitter must be at least 0 and shorter than both on and off"),
        ("sometimes", "write flights:on=4m,off=20m[,jitter=1m] or the absolute path of a CSV trace"),
        ("trace.csv", "an availability CSV must be an absolute path"),
    ],
)
def test_a_bad_trace_is_refused_with_what_to_write(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_availability(spec)


def test_a_bad_csv_is_refused_naming_the_line(tmp_path):
    with pytest.raises(ValueError, match="the first line must be agent,start_s,end_s"):
        parse_availability(write_csv(tmp_path / "a.csv", [], header="name,from,to"))
    with pytest.raises(ValueError, match="line 3: need 0 <= start_s < end_s, got 9, 3"):
        parse_availability(write_csv(tmp_path / "b.csv", [("agent-01", 0, 5), ("agent-02", 9, 3)]))
    with pytest.raises(ValueError, match="line 2: expected agent,start_s,end_s with numbers"):
        parse_availability(write_csv(tmp_path / "c.csv", [("agent-01", "soon", 5)]))


def test_the_gate_closes_while_the_trace_has_the_agent_away(tmp_path):
    path = write_csv(tmp_path / "trace.csv", [("agent-01", 0, 1000), ("agent-02", 1000, 2000)])
    now = time.time()
    policy = GatePolicy(availability=path, availability_origin=now - 10)
    with Telemetry(TelemetrySection(thermal_zones=""), policy, agent="agent-01") as here:
        assert here.reasons() == []
    with Telemetry(TelemetrySection(thermal_zones=""), policy, agent="agent-02") as away:
        (reason,) = away.reasons()
        assert reason.startswith("away: the availability trace has this agent offline (back in 16m")


def test_an_agent_config_whose_trace_never_names_it_is_refused_at_start(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1), ("127.0.0.1", 1883))
    config = layout.agent_configs["agent-01"]
    trace = write_csv(tmp_path / "trace.csv", [("agent-09", 0, 10)])
    config.write_text(config.read_text() + f'\n[gate]\navailability = "{trace}"\n')
    with pytest.raises(ConfigError, match="has no intervals for agent-01: add rows for every agent"):
        load_agent_config(config)
    config.write_text(config.read_text().replace(trace, "flights:on=1m,off=0s"))
    with pytest.raises(ConfigError, match="gate.availability = 'flights:on=1m,off=0s': flights: on and off must"):
        load_agent_config(config)


def test_sim_settings_check_the_trace_against_the_fleet_and_size_rounds_on_who_is_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_csv(tmp_path / "trace.csv", [("agent-01", 0, 10), ("agent-02", 0, 10)])
    settings = SimSettings(agents=2, availability="trace.csv")
    assert settings.availability == str(tmp_path / "trace.csv")  # each agent runs in its own folder
    with pytest.raises(ValueError, match="--availability: .* has no intervals for agent-03"):
        SimSettings(agents=3, availability="trace.csv")
    with pytest.raises(ValueError, match="--availability is not available with --in-process"):
        SimSettings(agents=2, availability="trace.csv", in_process=True)
    assert round_sizes("", agent_names(20), 20) == {"min_agents": 20, "quorum": 10}
    assert round_sizes("flights:on=5m,off=15m", agent_names(20), 20) == {"min_agents": 5, "quorum": 2}


def test_every_agent_gets_the_trace_in_its_own_gate_from_one_origin(tmp_path):
    spec = "flights:on=5m,off=15m"
    layout = create_federation(tmp_path, SimSettings(agents=2, rounds=1, availability=spec), ("127.0.0.1", 1883))
    gates = [load_agent_config(path).gate for path in layout.agent_configs.values()]
    assert {(g.availability, g.availability_origin) for g in gates} == {(spec, gates[0].availability_origin)}
    assert abs(gates[0].availability_origin - time.time()) < 60
    assert layout.description[-1] == f"availability: {spec} (each agent online 25% of the time; rounds start on 1)"
    with pytest.raises(ValueError, match="--availability is not available with --mode peer: a peer run ends once"):
        SimSettings(agents=2, mode="peer", availability=spec)


@pytest.mark.integration
def test_a_sim_under_a_trace_runs_its_rounds_on_the_agents_that_are_there(tmp_path, broker):
    """Three agents over the real broker; the trace keeps agent-03 away for the whole run: rounds start and close
    on the other two, and agent-03's own gate says why it sits out."""
    trace = write_csv(tmp_path / "trace.csv",
                      [("agent-01", 0, 10_000), ("agent-02", 0, 10_000), ("agent-03", 5_000, 10_000)])  # fmt: skip
    settings = SimSettings(agents=3, rounds=2, agents_per_process=3, epochs=1, partition="iid",
                           federation="trace", availability=trace)  # fmt: skip
    lines = []
    result = sim_run.run_sim(settings, tmp_path / "run", broker_address=broker.address, echo=lines.append)
    assert [m.round for m in result.metrics] == [1, 2]
    assert all(sorted(m.accepted) == ["agent-01", "agent-02"] for m in result.metrics)
    assert f"  availability: {trace} (each agent online 83% of the time; rounds start on 2)" in lines
    assert metrics_rows(tmp_path / "run")[0]["availability"] == trace
    log = (tmp_path / "run" / "federation" / "logs" / "agent-01..agent-03.log").read_text()
    assert "gate closed: away: the availability trace has this agent offline (back in 1h2" in log
