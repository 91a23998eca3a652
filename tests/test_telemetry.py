"""Telemetry gating: the policy's reasons, its config, and the real sources over real pseudo-terminals.

The flight controller is ``sim.flight_controller``: real MAVLink 2 bytes from pymavlink's encoder on a
pty, read by the agent through pyserial exactly as it would read /dev/ttyACM0.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import threading
import time
from pathlib import Path

import pytest
import tomllib
from pymavlink.dialects.v20 import common as mavlink

from agent.telemetry import (
    GatePolicy,
    Readings,
    SourceReading,
    Telemetry,
    TelemetrySection,
    check_gate_sources,
    gate_reasons,
)
from agent.telemetry.power import LineSerialSource, parse_line
from agent.telemetry.readings import ARMED, BATTERY, CHARGING, TEMPERATURE
from agent.telemetry.thermal import ThermalZones
from protocol.config import ConfigError, table
from sim.flight_controller import FlightController, open_pty

NOON = dt.time(12, 0)
STALE = re.compile(r"telemetry-stale: mavlink silent for \d+ s")
FC = frozenset({ARMED, BATTERY, CHARGING})
BOARD = frozenset({BATTERY, CHARGING, TEMPERATURE})


def fc(now: float = 100.0, **values) -> SourceReading:
    return SourceReading("mavlink", FC, heard_at=now, **values)


def board(now: float = 100.0, **values) -> SourceReading:
    return SourceReading("power_serial", BOARD, heard_at=now, **values)


def reasons(policy: GatePolicy, *sources: SourceReading, now: float = 100.0, local: dt.time = NOON) -> list[str]:
    return gate_reasons(policy, Readings(sources), now, local)


def wait_for(condition, timeout: float = 10.0) -> float:
    """Seconds until ``condition()`` held; fails the test after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - start


# the policy ----------------------------------------------------------------------------------------------


def test_nothing_configured_means_ready():
    assert reasons(GatePolicy()) == []
    with Telemetry(TelemetrySection(thermal_zones=""), GatePolicy()) as telemetry:
        assert telemetry.reasons() == []


def test_an_armed_flight_controller_closes_the_gate_unless_allowed():
    assert reasons(GatePolicy(), fc(armed=True)) == ["armed: the flight controller reports armed"]
    assert reasons(GatePolicy(), fc(armed=False)) == []
    assert reasons(GatePolicy(allow_armed=True), fc(armed=True)) == []


def test_the_armed_check_needs_a_flight_controller_but_fails_closed_before_its_first_heartbeat():
    assert reasons(GatePolicy(), board(battery_pct=90.0)) == []  # a device without a flight controller
    assert reasons(GatePolicy(), SourceReading("mavlink", FC)) == ["telemetry-missing: no armed state yet"]


@pytest.mark.parametrize("pct, expected", [(23.0, ["battery-low: 23% < 30%"]), (29.5, ["battery-low: 29.5% < 30%"]),
                                           (30.0, []), (100.0, [])])  # fmt: skip
def test_battery_below_the_minimum_closes_the_gate(pct, expected):
    assert reasons(GatePolicy(min_battery_pct=30), fc(armed=False, battery_pct=pct)) == expected


def test_the_lowest_battery_of_several_sources_counts():
    policy = GatePolicy(min_battery_pct=30)
    assert reasons(policy, fc(armed=False, battery_pct=90.0), board(battery_pct=12.0)) == ["battery-low: 12% < 30%"]


def test_charging_is_required_only_when_asked_and_every_source_must_agree():
    assert reasons(GatePolicy(), fc(armed=False, charging=False)) == []
    policy = GatePolicy(require_charging=True)
    assert reasons(policy, fc(armed=False, charging=False)) == ["not-charging"]
    assert reasons(policy, fc(armed=False, charging=True)) == []
    assert reasons(policy, fc(armed=False, charging=True), board(charging=False)) == ["not-charging"]
    assert reasons(policy, fc(armed=False)) == ["telemetry-missing: no charging state yet"]


@pytest.mark.parametrize("celsius, expected", [(71.5, ["too-hot: 71.5 °C > 70 °C (thermal_zone0 CPU-therm)"]),
                                               (70.0, [])])  # fmt: skip
def test_too_hot_names_the_hottest_sensor(celsius, expected):
    zone = SourceReading(
        "thermal", frozenset({TEMPERATURE}), 100.0, temperature_c=celsius, hottest="thermal_zone0 CPU-therm"
    )
    assert reasons(GatePolicy(max_temperature_c=70), zone, board(temperature_c=40.0)) == expected


@pytest.mark.parametrize(
    "hours, local, quiet",
    [
        ("22:00-06:00", dt.time(21, 59, 59), False),
        ("22:00-06:00", dt.time(22, 0), True),
        ("22:00-06:00", dt.time(23, 59, 59), True),
        ("22:00-06:00", dt.time(0, 0), True),
        ("22:00-06:00", dt.time(5, 59, 59), True),
        ("22:00-06:00", dt.time(6, 0), False),
        ("12:00-13:30", dt.time(12, 0), True),
        ("12:00-13:30", dt.time(13, 30), False),
        ("00:00-24:00", dt.time(23, 59, 59), True),
        ("18:00-24:00", dt.time(0, 0), False),
    ],
)
def test_quiet_hours_are_local_time_ranges_that_may_cross_midnight(hours, local, quiet):
    expected = [f"quiet-hours: {hours}"] if quiet else []
    assert reasons(GatePolicy(quiet_hours=("03:00-03:01", hours)), local=local) == expected


def test_a_silent_source_is_stale_and_its_old_values_no_longer_count():
    policy = GatePolicy(min_battery_pct=30, stale_after_s=10)
    silent = fc(now=88.0, armed=False, battery_pct=90.0)
    assert reasons(policy, silent, now=100.0) == ["telemetry-stale: mavlink silent for 12 s"]
    assert reasons(policy, silent, now=98.0) == []


def test_a_stale_source_the_policy_does_not_need_keeps_the_gate_open():
    assert reasons(GatePolicy(stale_after_s=10), board(now=0.0, battery_pct=10.0), now=100.0) == []


def test_a_needed_reading_that_never_came_fails_closed():
    policy = GatePolicy(min_battery_pct=30, max_temperature_c=80)
    assert reasons(policy, board(temperature_c=40.0)) == ["telemetry-missing: no battery reading yet"]
    assert reasons(policy) == ["telemetry-missing: no battery reading yet", "telemetry-missing: no temperature yet"]


# config --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, values, message",
    [
        (GatePolicy, {"min_battery_pct": 120}, "gate.min_battery_pct must be in 0..100"),
        (GatePolicy, {"max_temperature_c": -5}, "gate.max_temperature_c must be in 0..150"),
        (GatePolicy, {"stale_after_s": 0}, "gate.stale_after_s must be > 0"),
        (GatePolicy, {"quiet_hours": ("22-06",)}, "gate.quiet_hours[0] = '22-06': expected \"HH:MM-HH:MM\""),
        (GatePolicy, {"quiet_hours": ("01:00-02:00", "25:00-06:00")}, "gate.quiet_hours[1] = '25:00-06:00': hours"),
        (GatePolicy, {"quiet_hours": ("06:00-06:00",)}, 'for the whole day write "00:00-24:00"'),
        (TelemetrySection, {"mavlink": "ttyTHS1"}, 'telemetry.mavlink must be an absolute path like "/dev/ttyTHS1"'),
        (TelemetrySection, {"power_serial": "usb0"}, "telemetry.power_serial must be an absolute path"),
        (TelemetrySection, {"thermal_zones": "sys"}, "telemetry.thermal_zones must be an absolute path"),
        (TelemetrySection, {"mavlink_baud": 0}, "telemetry.mavlink_baud must be a positive baud rate"),
    ],
)
def test_bad_values_are_refused_naming_the_key_and_the_fix(cls, values, message):
    with pytest.raises(ValueError) as error:
        cls(**values)
    assert message in str(error.value)


def test_a_condition_without_a_source_is_refused_at_start():
    with pytest.raises(ValueError, match="gate.min_battery_pct = 30 needs a battery source: set telemetry.mavlink"):
        check_gate_sources(GatePolicy(min_battery_pct=30), TelemetrySection())
    with pytest.raises(ValueError, match="gate.require_charging = true needs a charging source"):
        check_gate_sources(GatePolicy(require_charging=True), TelemetrySection())
    with pytest.raises(ValueError, match="gate.max_temperature_c = 70 needs a temperature source"):
        check_gate_sources(GatePolicy(max_temperature_c=70), TelemetrySection(thermal_zones=""))
    check_gate_sources(GatePolicy(min_battery_pct=30, max_temperature_c=70), TelemetrySection(power_serial="/dev/x"))


EXAMPLE_TOML = """
[gate]
min_battery_pct = 30
require_charging = false
allow_armed = false
max_temperature_c = 75
quiet_hours = ["22:00-06:00"]
stale_after_s = 10

[telemetry]
mavlink = "/dev/ttyTHS1"
mavlink_baud = 57600
power_serial = ""
power_baud = 115200
thermal_zones = "/sys/class/thermal"
thermal_ignore = ["PMIC-Die"]
"""


def test_the_example_toml_tables_load_and_a_typo_is_refused(tmp_path):
    data = tomllib.loads(EXAMPLE_TOML)
    gate = table(tmp_path / "agent.toml", data, "gate", GatePolicy)
    telemetry = table(tmp_path / "agent.toml", data, "telemetry", TelemetrySection)
    assert gate.quiet_hours == ("22:00-06:00",) and gate.min_battery_pct == 30.0
    assert telemetry.mavlink == "/dev/ttyTHS1" and telemetry.thermal_ignore == ("PMIC-Die",)
    check_gate_sources(gate, telemetry)
    with pytest.raises(ConfigError, match="gate.min_battery is not a known key; did you mean 'min_battery_pct'"):
        table(tmp_path / "agent.toml", {"gate": {"min_battery": 30}}, "gate", GatePolicy)


# the power board -----------------------------------------------------------------------------------------


def test_power_board_lines_parse_known_keys_and_ignore_unknown_ones():
    assert parse_line("battery=87 charging=1 temp=41.5") == {
        "battery_pct": 87.0,
        "charging": True,
        "temperature_c": 41.5,
    }
    assert parse_line("volts=12.1,charging=false") == {"charging": False}
    for bad in ("battery", "battery=abc", "battery=150", "charging=maybe", "=1", "temp=999"):
        with pytest.raises(ValueError):
            parse_line(bad)


def test_power_board_over_a_pty_survives_malformed_lines():
    master, slave, device = open_pty()
    source = LineSerialSource(device, 115200)
    try:
        source.start()

        def board_sends_and_agent_heard() -> bool:  # pyserial flushes what arrived before it opened the port
            os.write(master, b"battery=87 charging=1 temp=41.5\r\n")
            return source.reading().battery_pct == 87.0

        wait_for(board_sends_and_agent_heard)
        assert source.reading().charging is True and source.reading().temperature_c == 41.5
        overlong = b"battery=10" + b" volts=12.1" * 30  # well-formed, but past MAX_LINE: a runaway sender
        os.write(master, b"garbage\nbattery=abc\n" + overlong + b"\n\xff\xfe\n\nbattery=55 volts=12.1\n")
        wait_for(lambda: source.reading().battery_pct == 55.0)
        assert source.malformed == 4  # the empty line is not malformed
        os.write(master, overlong * 3)  # no newline yet: dropped as it grows, not buffered without bound
        time.sleep(0.1)
        os.write(master, b"\n")
        os.write(master, b"battery=4")  # a line split across reads is never taken by halves
        time.sleep(0.05)
        os.write(master, b"2 charging=0\n")
        wait_for(lambda: source.reading().charging is False)
        assert source.reading().battery_pct == 42.0
        assert source.malformed == 5
    finally:
        source.stop()
        os.close(master)
        os.close(slave)


# thermal zones -------------------------------------------------------------------------------------------


def fake_zone(root: Path, index: int, kind: str, temp: str | None) -> None:
    zone = root / f"thermal_zone{index}"
    zone.mkdir(parents=True)
    (zone / "type").write_text(kind + "\n")
    if temp is not None:
        (zone / "temp").write_text(temp + "\n")


def test_thermal_zones_report_the_hottest_real_sensor(tmp_path):
    fake_zone(tmp_path, 0, "CPU-therm", "45000")
    fake_zone(tmp_path, 1, "GPU-therm", "71500")
    fake_zone(tmp_path, 2, "PMIC-Die", "100000")  # a placeholder value, ignored by default
    fake_zone(tmp_path, 3, "AO-therm", "garbage")
    fake_zone(tmp_path, 4, "Tdiode", None)
    fake_zone(tmp_path, 5, "broken", "-274000")
    reading = ThermalZones(str(tmp_path), ("PMIC-Die",)).reading()
    assert (reading.temperature_c, reading.hottest) == (71.5, "thermal_zone1 GPU-therm")
    telemetry = Telemetry(TelemetrySection(thermal_zones=str(tmp_path)), GatePolicy(max_temperature_c=70))
    assert telemetry.reasons() == ["too-hot: 71.5 °C > 70 °C (thermal_zone1 GPU-therm)"]
    (tmp_path / "thermal_zone1" / "temp").write_text("52000\n")
    assert telemetry.reasons() == []


def test_no_thermal_zones_fail_closed_when_temperature_matters(tmp_path):
    telemetry = Telemetry(TelemetrySection(thermal_zones=str(tmp_path / "none")), GatePolicy(max_temperature_c=70))
    assert telemetry.reasons() == ["telemetry-missing: no temperature yet"]


# the flight controller -----------------------------------------------------------------------------------


@pytest.fixture
def flight_controller():
    with FlightController(rate_hz=10, battery_pct=80) as controller:
        yield controller


def mavlink_telemetry(device: str, **policy) -> Telemetry:
    section = TelemetrySection(mavlink=device, thermal_zones="")
    return Telemetry(section, GatePolicy(**policy), retry_s=0.2).start()


def test_arming_shows_up_in_the_gate_within_a_second_and_disarming_clears_it(flight_controller):
    telemetry = mavlink_telemetry(flight_controller.device)
    try:
        wait_for(lambda: telemetry.snapshot().sources[0].armed is False)
        assert telemetry.reasons() == []
        flight_controller.arm()
        assert wait_for(lambda: telemetry.reasons() == ["armed: the flight controller reports armed"]) < 1.0
        flight_controller.disarm()
        assert wait_for(lambda: telemetry.reasons() == []) < 1.0
    finally:
        telemetry.stop()


def test_battery_and_charging_arrive_from_the_flight_controller(flight_controller):
    telemetry = mavlink_telemetry(flight_controller.device, min_battery_pct=30, require_charging=True)
    try:
        wait_for(lambda: telemetry.reasons() == ["not-charging"])
        assert telemetry.summary()["mavlink"]["battery_pct"] == 80.0
        flight_controller.set_battery(23, charging=True)
        wait_for(lambda: telemetry.reasons() == ["battery-low: 23% < 30%"])
        flight_controller.set_battery(64)
        wait_for(lambda: telemetry.reasons() == [])
        payload = mavlink.MAVLink(None, srcSystem=1, srcComponent=mavlink.MAV_COMP_ID_BATTERY)
        for _ in range(5):  # a second battery (a payload's) is not the one SYS_STATUS reports: it does not count
            flight_controller.send_raw(payload.battery_status_encode(1, 0, 0, 0, [0] * 10, -1, -1, -1, 5).pack(payload))
            time.sleep(0.02)
            assert telemetry.reasons() == []
    finally:
        telemetry.stop()


def test_a_silent_flight_controller_makes_the_gate_stale(flight_controller):
    telemetry = mavlink_telemetry(flight_controller.device, stale_after_s=0.5)
    try:
        wait_for(lambda: telemetry.snapshot().sources[0].armed is False)
        flight_controller.pause()
        wait_for(lambda: STALE.fullmatch(" ".join(telemetry.reasons())) is not None)
        flight_controller.resume()
        wait_for(lambda: telemetry.reasons() == [])
    finally:
        telemetry.stop()


def test_heartbeats_from_a_ground_station_a_camera_or_another_vehicle_and_line_noise_do_not_count(flight_controller):
    armed = mavlink.MAV_MODE_FLAG_SAFETY_ARMED
    gcs = mavlink.MAVLink(None, srcSystem=255, srcComponent=190)
    camera = mavlink.MAVLink(None, srcSystem=1, srcComponent=mavlink.MAV_COMP_ID_CAMERA)
    other_vehicle = mavlink.MAVLink(None, srcSystem=2, srcComponent=1)
    frames = [
        b"\x00noise\x55" * 3,
        gcs.heartbeat_encode(mavlink.MAV_TYPE_GCS, mavlink.MAV_AUTOPILOT_GENERIC, armed, 0, 0).pack(gcs),
        camera.heartbeat_encode(mavlink.MAV_TYPE_CAMERA, mavlink.MAV_AUTOPILOT_INVALID, armed, 0, 0).pack(camera),
    ]
    flight_controller.pause()  # at first only the others talk: none of them may pass for the autopilot
    telemetry = mavlink_telemetry(flight_controller.device)
    source = telemetry.serial[0]

    def others_send() -> bool:
        for frame in frames:
            flight_controller.send_raw(bytes(frame))
        return source.bad_frames > 0  # the port is open: the noise was read

    try:
        wait_for(others_send)
        for _ in range(10):
            others_send()
            time.sleep(0.02)
            assert telemetry.reasons() == ["telemetry-missing: no armed state yet"]
        flight_controller.resume()
        wait_for(lambda: telemetry.reasons() == [])
        frames.append(other_vehicle.heartbeat_encode(mavlink.MAV_TYPE_QUADROTOR, mavlink.MAV_AUTOPILOT_PX4,
                                                     armed, 0, 0).pack(other_vehicle))  # fmt: skip
        for _ in range(10):
            others_send()
            time.sleep(0.02)
            assert telemetry.reasons() == []
        flight_controller.arm()  # the parser is still in step with the real autopilot
        assert wait_for(lambda: telemetry.reasons() == ["armed: the flight controller reports armed"]) < 1.0
    finally:
        telemetry.stop()


def test_a_vanished_flight_controller_goes_stale_and_is_reopened_when_it_comes_back(tmp_path):
    link = tmp_path / "ttyFC"  # a stable name, as udev gives a USB flight controller
    first = FlightController(rate_hz=10).start()
    link.symlink_to(first.device)
    telemetry = mavlink_telemetry(str(link), stale_after_s=0.5)
    try:
        wait_for(lambda: telemetry.reasons() == [])
        first.stop()
        wait_for(lambda: STALE.fullmatch(" ".join(telemetry.reasons())) is not None)
        with FlightController(rate_hz=10, system=2) as second:  # a replaced autopilot may have another id
            second.arm()
            link.unlink()
            link.symlink_to(second.device)
            wait_for(lambda: telemetry.reasons() == ["armed: the flight controller reports armed"], timeout=3.0)
    finally:
        telemetry.stop()


def test_arming_mid_round_cancels_training_before_the_update_is_sent(flight_controller):
    telemetry = mavlink_telemetry(flight_controller.device)
    cancelled, finished, sent = threading.Event(), threading.Event(), []

    def training() -> None:  # 4 s of work unless cancelled, as the daemon's training job
        for _ in range(200):
            if cancelled.is_set():
                return
            time.sleep(0.02)
        finished.set()

    try:
        wait_for(lambda: telemetry.reasons() == [])
        job = threading.Thread(target=training)
        job.start()
        threading.Timer(0.2, flight_controller.arm).start()
        started, reasons = time.monotonic(), []
        while job.is_alive() and not reasons:  # the daemon's loop: poll the job, ask the gate
            reasons = telemetry.reasons()
            time.sleep(0.05)
        if reasons:
            cancelled.set()
        job.join()
        if finished.is_set() and not telemetry.reasons():
            sent.append("update")
        assert reasons == ["armed: the flight controller reports armed"]
        assert time.monotonic() - started < 1.5
        assert not finished.is_set() and sent == []
    finally:
        telemetry.stop()
