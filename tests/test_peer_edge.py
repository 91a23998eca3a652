"""A peer runs in the edge node's shell (agent.edge_node) as an edge agent does, over a real broker: its battery
below ``gate.min_battery_pct`` (an emulated flight controller: real MAVLink bytes over a pty) keeps it from
training and its signed membership says why; charged, it trains. Its Prometheus endpoint (``[metrics]``, which
a peer refused before it ran in the shell) shows both, as an edge agent's does; and a broker that drops what it
publishes (its ACL does not name it yet) is reported, as for an edge agent (agent.echo)."""

from __future__ import annotations

import threading

from agent.config import load_agent_config
from agent.echo import PublishEcho
from agent.peer.node import PeerNode
from agent.peer.rounds import read_metrics
from agent.runner import in_process_runner
from sim.broker import free_port
from sim.federation import write_classify_data
from sim.flight_controller import FlightController
from tests.fedharness import override_toml, wait_until
from tests.liveharness import (
    HONEST,
    PEER_MODE,
    Peers,
    SlowInRound,
    peer_configs,
    provision_exit,
    scrape_or_none,
    seen_by,
    state,
)


def test_a_peer_on_low_battery_does_not_train_says_why_and_trains_once_charged(tmp_path, broker, peers: Peers):
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


def test_a_peer_missing_from_the_loaded_acl_says_its_publishes_are_dropped(peer_broker):
    """The edge node checks that what a role publishes comes back (agent.echo), a peer's membership as an agent's
    status: a peer provisioned after the broker loaded its ACL says the broker drops it (on main: silence)."""
    out, broker, port = peer_broker
    assert provision_exit(out, "p1,p2,p3,p4", port, PEER_MODE) == 0  # p4 added; the broker still holds the old ACL
    write_classify_data(out.parent / "state", ["p1", "p4"], "iid", seed=0)
    nodes = {}
    for name in ("p1", "p4"):
        path = out / "peers" / name / "agent.toml"
        override_toml(path, federation={"model": "digits_cnn", "rounds": 1, "threshold": 2},
                      training={"threads": 1})  # fmt: skip
        config = load_agent_config(path)
        nodes[name] = PeerNode(config, runner=in_process_runner(config))
        nodes[name].edge.echo = PublishEcho(timeout_s=3.0)
    stop = threading.Event()
    threads = [threading.Thread(target=node.run, args=(stop,), daemon=True) for node in nodes.values()]
    for thread in threads:
        thread.start()
    try:
        problem = wait_until(lambda: nodes["p4"].edge.mqtt.problem, 30, "p4 reports a problem")
        assert "the broker drops what this agent publishes" in problem and "systemctl reload mosquitto" in problem
        assert nodes["p1"].edge.mqtt.problem is None and nodes["p1"].edge.mqtt.connected.is_set()
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
