"""A peer runs in the edge node's shell (agent.edge_node) as an edge agent does, over a real broker: its battery
below ``gate.min_battery_pct`` (an emulated flight controller: real MAVLink bytes over a pty) keeps it from
training and its signed membership says why; charged, it trains. Its Prometheus endpoint (``[metrics]``, which
a peer refused before it ran in the shell) shows both, as an edge agent's does."""

from __future__ import annotations

from agent.config import load_agent_config
from agent.peer.rounds import read_metrics
from sim.broker import free_port
from sim.flight_controller import FlightController
from tests.fedharness import override_toml, wait_until
from tests.test_federation import SlowInRound
from tests.test_peer import Peers, peer_configs, state
from tests.test_peer_gate import HONEST, peers, seen_by  # noqa: F401 - fixture
from tests.test_prometheus import scrape_or_none


def test_a_peer_on_low_battery_does_not_train_says_why_and_trains_once_charged(tmp_path, broker, peers: Peers):  # noqa: F811
    configs = peer_configs(tmp_path, broker, rounds=2, round_timeout_s=30.0)
    port = free_port()
    with FlightController(rate_hz=10.0, battery_pct=15) as flight_controller:
        override_toml(configs["agent-01"], telemetry={"mavlink": flight_controller.device},
                      gate={"min_battery_pct": 30}, metrics={"prometheus_port": port})  # fmt: skip
        assert load_agent_config(configs["agent-01"]).metrics.prometheus_port == port  # on main: refused
        drone = peers.start(configs["agent-01"])
        for name in HONEST:  # slow in round 2: the drone, charged, catches up while that round is open
            peers.start(configs[name], wrap=lambda inner: SlowInRound(inner, round_number=2, delay_s=8.0))
        wait_until(lambda: (m := seen_by(peers, "agent-02", "agent-01")) is not None and not m.gate.ok, 30,
                   "agent-02 hears why agent-01 sits out")  # fmt: skip
        assert [r.split(":")[0] for r in seen_by(peers, "agent-02", "agent-01").gate.reasons] == ["battery-low"]
        wait_until(lambda: all((m := seen_by(peers, "agent-01", p)) is not None and m.round == 2 for p in HONEST), 30,
                   "round 1 without it")  # fmt: skip
        closed = wait_until(lambda: scrape_or_none(port), 10, "the peer's metrics")
        assert drone.work.phase == "gated" and drone.work.client.progress.last_completed_round == 0
        assert closed[("skyfed_agent_gate_open", ())] == 0 and closed[("skyfed_agent_gate_reasons", ())] == 1
        assert closed[("skyfed_agent_training_seconds_total", ())] == 0
        assert closed[("skyfed_agent_updates_sent_total", ())] == 0
        flight_controller.set_battery(80)
        wait_until(lambda: (m := seen_by(peers, "agent-02", "agent-01")) is not None and m.gate.ok, 30,
                   "agent-02 sees agent-01's gate open")  # fmt: skip
        sent = ("skyfed_agent_updates_sent_total", ())  # read while it runs: its endpoint closes as it stops
        opened = wait_until(lambda: (s := scrape_or_none(port)) is not None and s[sent] == len(HONEST) and s, 60,
                            "its round-2 update sealed to each member")  # fmt: skip
        peers.wait_done(["agent-01", *HONEST], timeout_s=90)
    (line,) = read_metrics(state(configs["agent-01"]))  # it joined the members' round 2 and trained it
    assert (line["round"], line["aggregated_from"]) == (2, ["agent-01", *HONEST])
    assert opened[("skyfed_agent_gate_open", ())] == 1 and opened[("skyfed_agent_gate_reasons", ())] == 0
    assert opened[("skyfed_agent_training_seconds_total", ())] > 0
    assert opened[("skyfed_agent_last_completed_round", ())] == 2 and opened[("skyfed_agent_round", ())] == 2
