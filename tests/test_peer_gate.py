"""A peer honours its device gate as an edge agent does (``[gate]``, ``[telemetry]``: agent.telemetry), over a
real broker: closed (quiet hours, or an emulated flight controller arming mid-round: real MAVLink bytes over a
pty) it does not train, its signed membership says why and the other peers neither wait for it nor count it;
once the gate opens it trains again, catching up with the members' round."""

from __future__ import annotations

import datetime as dt

from agent.peer.rounds import read_metrics
from sim.flight_controller import FlightController
from tests.fedharness import override_toml, wait_until
from tests.liveharness import HONEST, SlowInRound, peer_configs, seen_by, state


def quiet_now() -> str:
    """Quiet hours from a minute ago to five minutes on (across midnight if it must)."""
    now = dt.datetime.now()
    return f"{now - dt.timedelta(minutes=1):%H:%M}-{now + dt.timedelta(minutes=5):%H:%M}"


def test_a_peer_in_its_quiet_hours_does_not_train_says_why_and_is_not_waited_for(tmp_path, broker, peers):
    configs = peer_configs(tmp_path, broker, rounds=2, round_timeout_s=60.0)
    override_toml(configs["agent-01"], gate={"quiet_hours": [quiet_now()]})
    quiet = peers.start(configs["agent-01"])
    for name in HONEST:
        peers.start(configs[name])
    peers.wait_done(HONEST, timeout_s=45)  # waiting for it would take round_timeout_s (60 s) at the start alone
    member = seen_by(peers, "agent-02", "agent-01")
    assert member is not None and member.state == "member" and not member.gate.ok
    assert [r.split(":")[0] for r in member.gate.reasons] == ["quiet-hours"]
    for name in HONEST:
        lines = read_metrics(state(configs[name]))
        assert [(line["aggregated_from"], line["members"]) for line in lines] == [(HONEST, HONEST)] * 2
        assert all(line["wait_s"] < 30 for line in lines)
    assert quiet.work.phase == "gated" and quiet.work.describe().startswith("gated (quiet-hours: ")
    assert read_metrics(state(configs["agent-01"])) == [] and quiet.work.client.progress.last_completed_round == 0


def test_a_peer_whose_drone_arms_mid_round_stops_training_and_catches_up_once_disarmed(tmp_path, broker, peers):
    configs = peer_configs(tmp_path, broker, rounds=2, round_timeout_s=30.0)
    with FlightController(rate_hz=10.0, battery_pct=80) as flight_controller:
        override_toml(configs["agent-01"], telemetry={"mavlink": flight_controller.device})
        drone = peers.start(configs["agent-01"], wrap=lambda inner: SlowInRound(inner, round_number=1, delay_s=3.0))
        for name in HONEST:  # slow in round 2: the drone, disarmed, catches up while that round is open
            peers.start(configs[name], wrap=lambda inner: SlowInRound(inner, round_number=2, delay_s=8.0))
        wait_until(lambda: drone.work.phase == "training" and drone.work.round == 1, 60, "the drone to train")
        flight_controller.arm()
        wait_until(lambda: drone.work.phase == "gated", 5, "arming to stop the training")
        wait_until(lambda: not seen_by(peers, "agent-02", "agent-01").gate.ok, 5, "the others to hear why")
        assert seen_by(peers, "agent-02", "agent-01").gate.reasons == ["armed: the flight controller reports armed"]
        wait_until(lambda: all(seen_by(peers, "agent-01", p).round == 2 for p in HONEST), 30, "round 1 without it")
        assert drone.work.client.progress.last_completed_round == 0  # its round-1 job cancelled: nothing trained
        flight_controller.disarm()
        # agent-02's view of agent-01 while both run: a peer that finishes first leaves, and the roster drops it
        wait_until(lambda: (m := seen_by(peers, "agent-02", "agent-01")) is not None and m.gate.ok, 60,
                   "agent-02 sees agent-01's gate open")  # fmt: skip
        rejoined = seen_by(peers, "agent-02", "agent-01")
        peers.wait_done(["agent-01", *HONEST], timeout_s=90)
    everyone = ["agent-01", *HONEST]
    for name in HONEST:
        lines = read_metrics(state(configs[name]))
        assert [(line["round"], line["aggregated_from"]) for line in lines] == [(1, HONEST), (2, everyone)]
        assert lines[0]["wait_s"] < 20  # round 1 did not wait for the gated drone
    (line,) = read_metrics(state(configs["agent-01"]))  # it joined the members' round 2 and trained it
    assert (line["round"], line["aggregated_from"]) == (2, everyone)
    assert rejoined.gate.ok
