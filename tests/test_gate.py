"""The device gate in the agent daemon: an emulated flight controller (real MAVLink bytes over a pty) arms
mid-round, training stops and no update leaves; the status says why; once disarmed the round trains."""

from __future__ import annotations

import pytest

from sim.flight_controller import FlightController
from tests.fedharness import Federation, override_toml, wait_until
from tests.liveharness import SlowInRound


@pytest.fixture
def flight_controller():
    with FlightController(rate_hz=10.0, battery_pct=80) as fc:
        yield fc


def test_arming_mid_round_stops_training_and_nothing_is_sent_until_disarmed(tmp_path, broker, flight_controller):
    def wire_telemetry(layout):  # noqa: ANN001
        override_toml(layout.agent_configs["agent-01"], telemetry={"mavlink": flight_controller.device},
                      gate={"min_battery_pct": 30})  # fmt: skip

    fed = Federation(tmp_path, broker, rounds=1, agents=2, edit=wire_telemetry, strategy={"name": "fedavg"})
    drone = fed.agents[0]
    drone.runner.trainer = SlowInRound(drone.runner.trainer, round_number=1, delay_s=4.0)
    server, server_thread = fed.start_with_server()
    try:
        wait_until(lambda: drone.state == "training", 60, "the drone to start training")
        flight_controller.arm()
        wait_until(lambda: drone.state == "gated", 5, "arming to stop the training")
        status = drone.report.status()
        assert not status.gate.ok and any(r.startswith("armed:") for r in status.gate.reasons)
        assert drone.client.progress.last_completed_round == 0 and drone.client.store.stored_update(1) is None
        assert drone.edge.errors == 0  # a closed gate is not a failure
        flight_controller.set_battery(20)
        wait_until(lambda: any(r.startswith("battery-low: 20%") for r in drone.report.gate_reasons()), 5, "battery")
        assert server.engine.round_state is not None and "agent-01" in server.engine.round_state.pending
        flight_controller.disarm()
        flight_controller.set_battery(90)
        server_thread.join(90)
        assert not server_thread.is_alive(), "the federation did not finish"
    finally:
        fed.close()
    (metrics,) = fed.metrics()
    assert sorted(metrics.accepted) == ["agent-01", "agent-02"]  # trained again once the gate opened
    assert drone.report.status().gate.ok


def test_a_gate_policy_no_source_can_satisfy_is_refused_at_start(tmp_path):
    from agent.config import load_agent_config
    from protocol.config import ConfigError
    from sim.federation import SimSettings, create_federation

    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1), ("127.0.0.1", 1))
    config = layout.agent_configs["agent-01"]
    override_toml(config, gate={"min_battery_pct": 30})
    with pytest.raises(ConfigError, match="gate.min_battery_pct = 30 needs a battery source"):
        load_agent_config(config)
