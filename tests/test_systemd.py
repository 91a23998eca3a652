"""systemd: the sd_notify client, the units (``systemd-analyze verify`` and ``security``), and each unit's
own ExecStart command run under a NOTIFY_SOCKET this test owns, against a real mosquitto: READY=1 only
once the broker answered, WATCHDOG=1 at half the interval, STATUS= lines, STOPPING=1 on SIGTERM, and an
exit within 2 s of SIGTERM even when the broker is gone."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from itertools import pairwise
from pathlib import Path

import pytest

from common.sdnotify import Notifier
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import Topics
from sim.broker import free_port
from sim.federation import SimSettings, create_federation
from tests.fedharness import wait_until

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = {"agent": "skyfed-agent.service", "server": "skyfed-server.service", "dashboard": "skyfed-dashboard.service"}
INSTALLED_SKYFED = "/opt/skyfed/venv/bin/skyfed"  # where deploy/install-*.sh put the venv
STOP_BOUND_S = 2.0  # the required bound from SIGTERM to exit, interpreter exit included; measured 0.5-1.0 s


def service_section(unit: str) -> dict[str, list[str]]:
    """The [Service] assignments of a unit, each key with all its values (systemd keys repeat)."""
    values: dict[str, list[str]] = {}
    section = ""
    for line in (SYSTEMD / unit).read_text().replace("\\\n", " ").splitlines():  # systemd's line continuation
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


def rendered(tmp_path: Path, unit: str) -> Path:
    """A copy of ``unit`` whose ExecStart names a file that exists here (``verify`` checks it)."""
    path = tmp_path / unit
    text = (SYSTEMD / unit).read_text()
    assert INSTALLED_SKYFED in text
    path.write_text(text.replace(INSTALLED_SKYFED, sys.executable))
    return path


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not installed")
    return found


class NotifySocket:
    """Stands in for systemd's notification socket (an abstract one): every datagram, with its arrival time."""

    def __init__(self) -> None:
        self.address = f"@skyfed-test-{secrets.token_hex(8)}"
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind("\0" + self.address[1:])
        self._socket.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._open = True
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while self._open:
            try:
                data = self._socket.recv(4096)
            except TimeoutError:
                continue
            lines = data.decode().splitlines()
            self.messages.append((time.monotonic(), dict(line.partition("=")[::2] for line in lines)))

    def received(self, key: str, since: float = 0.0) -> list[tuple[float, str]]:
        return [(at, m[key]) for at, m in list(self.messages) if key in m and at >= since]

    def wait(self, key: str, match: str = "", timeout_s: float = 60.0, since: float = 0.0) -> float:
        """When the first ``key=…`` containing ``match`` arrived (after ``since``)."""
        found = wait_until(
            lambda: [at for at, value in self.received(key, since) if match in value], timeout_s, f"{key}={match}…"
        )
        return found[0]

    def __enter__(self) -> NotifySocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self._open = False
        self._reader.join()
        self._socket.close()


def federation(tmp_path: Path, broker) -> tuple[Topics, dict[str, Path]]:  # noqa: ANN001
    layout = create_federation(tmp_path / "fed", SimSettings(agents=1, rounds=1), (broker.host, broker.port))
    return Topics(SimSettings().federation), {"server": layout.server_config, "agent": layout.agent_configs["agent-01"]}


def unit_command(role: str, config: Path, state_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The unit's ExecStart and Environment= with this checkout's skyfed, ``config`` and ``state_dir``."""
    service = service_section(UNITS[role])
    argv = shlex.split(service["ExecStart"][0])
    assert argv[0] == INSTALLED_SKYFED and f"/etc/skyfed/{role}.toml" in argv
    skyfed = Path(sys.executable).with_name("skyfed")  # the venv's console script, like the installed one
    prefix = [str(skyfed)] if skyfed.exists() else [sys.executable, "-m", "skyfed"]
    argv = prefix + [str(config) if arg == f"/etc/skyfed/{role}.toml" else arg for arg in argv[1:]]
    env = dict(os.environ)
    for line in service["Environment"]:
        for assignment in shlex.split(line):
            key, _, value = assignment.partition("=")
            env[key] = value.replace("/var/lib/skyfed", str(state_dir))
    return argv, env


def retained(broker, topic: str) -> dict:  # noqa: ANN001
    client = MqttClient(f"probe-{secrets.token_hex(4)}", BrokerSettings(broker.host, broker.port), persistent=False)
    client.subscribe(topic)
    try:
        assert client.start(10), "the probe could not connect"
        return json.loads(wait_until(lambda: client.poll(0.1), 10, f"retained {topic}")[1])
    finally:
        client.stop()


def stop(process: subprocess.Popen) -> float:
    """SIGTERM, then the seconds until the process is gone."""
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    return time.monotonic() - started


def test_dashboard_unit_command_serves_the_page_and_stops_within_2_s_of_sigterm():
    """The unit's ExecStart as systemd expands it (``${X}`` one word, ``$X`` split into words)."""
    service = service_section(UNITS["dashboard"])
    env = dict(os.environ)
    for line in service["Environment"]:
        env.update(assignment.partition("=")[::2] for assignment in shlex.split(line))
    env["SKYFED_DASHBOARD_PORT"] = str(free_port())
    words = shlex.split(service["ExecStart"][0])
    argv: list[str] = []
    for word in words:
        if word.startswith("${"):
            argv.append(env[word[2:-1]])
        elif word.startswith("$"):
            argv.extend(env[word[1:]].split())
        else:
            argv.append(word)
    assert argv[:2] == [INSTALLED_SKYFED, "dashboard"]
    argv[0:1] = [sys.executable, "-m", "skyfed"]
    process = subprocess.Popen(argv, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{env['SKYFED_DASHBOARD_PORT']}/config.js"
        config = wait_until(lambda: _get(url), 10, "the dashboard page")
        assert f'"ws_port": {env["SKYFED_WS_PORT"]}' in config and '"tls": true' in config
    finally:
        assert stop(process) < STOP_BOUND_S
    assert "event=dashboard-started" in process.stdout.read()


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.read().decode()
    except OSError:
        return None


# the sd_notify client ---------------------------------------------------------------------------------
def receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + address[1:] if address.startswith("@") else address)
    sock.settimeout(1)
    return sock


def drained(sock: socket.socket) -> list[str]:
    sock.settimeout(0.05)
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            return messages


def test_notifier_does_nothing_without_notify_socket():
    notifier = Notifier({"WATCHDOG_USEC": "1000000"})
    assert notifier.watchdog_s is None and not notifier.send("READY=1")
    notifier.keep_alive()
    notifier.status("round 1: training")


def test_notifier_reaches_a_path_socket_and_an_abstract_one():
    with tempfile.TemporaryDirectory(prefix="sdn-") as folder:  # AF_UNIX paths must stay under 108 bytes
        for address in (f"{folder}/notify", f"@skyfed-test-{secrets.token_hex(8)}"):
            with receiver(address) as sock:
                assert Notifier({"NOTIFY_SOCKET": address}).send("READY=1", "STATUS=connected")
                assert sock.recv(4096) == b"READY=1\nSTATUS=connected"


def test_watchdog_pings_at_half_the_interval_and_only_for_the_watched_pid():
    address, now = f"@skyfed-test-{secrets.token_hex(8)}", [100.0]
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "4242"}
    with receiver(address) as sock:
        notifier = Notifier(env, pid=4242, clock=lambda: now[0])
        assert notifier.watchdog_s == 2.0
        notifier.keep_alive(starting=True)  # before READY: also extend the start timeout by one interval
        for now[0] in (100.5, 100.99, 101.0):
            notifier.keep_alive()
        assert drained(sock) == ["WATCHDOG=1\nEXTEND_TIMEOUT_USEC=2000000", "WATCHDOG=1"]
        child = Notifier(env, pid=4243)  # inherited the variables: the watchdog is not its business
        assert child.watchdog_s is None
        child.keep_alive()
        assert drained(sock) == []


def test_status_goes_out_once_per_change_on_one_line():
    address = f"@skyfed-test-{secrets.token_hex(8)}"
    with receiver(address) as sock:
        notifier = Notifier({"NOTIFY_SOCKET": address})
        notifier.status("round 2: training")
        notifier.status("round 2: training")
        notifier.status("round 2:\ntraining", "STOPPING=1")
        assert drained(sock) == ["STATUS=round 2: training", "STOPPING=1\nSTATUS=round 2:\\ntraining"]


def test_a_failed_notification_is_dropped_with_one_log_line(caplog):
    notifier = Notifier({"NOTIFY_SOCKET": "/nonexistent/notify"})
    with caplog.at_level(logging.WARNING, logger="skyfed.systemd"):
        assert not notifier.send("READY=1")
        assert not notifier.send("WATCHDOG=1")
    assert len(caplog.records) == 1 and "sd_notify failed" in caplog.text


def test_logs_into_the_journal_carry_their_priority_on_every_line_and_no_timestamp(tmp_path):
    code = (
        "import logging; from common.logs import configure_logging; configure_logging('info'); "
        "logging.getLogger('skyfed.x').warning('first\\nsecond', exc_info=(ValueError, ValueError('why'), None))"
    )  # a message is one line (a newline in it is shown escaped); a traceback keeps its lines, each with its priority
    with open(tmp_path / "journal", "wb") as stream:
        journal = os.fstat(stream.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{journal.st_dev}:{journal.st_ino}"}
        subprocess.run([sys.executable, "-c", code], stderr=stream, env=env, cwd=ROOT, check=True)
    assert (tmp_path / "journal").read_text() == "<4>WARNING skyfed.x: first\\nsecond\n<4>ValueError: why\n"
    inherited = subprocess.run([sys.executable, "-c", code], env={**env, "JOURNAL_STREAM": "1:2"}, cwd=ROOT,
                               capture_output=True, text=True, check=True)  # fmt: skip
    line = r"\d{4}-\d\d-\d\d [\d:,]+ WARNING skyfed.x: first\\nsecond\nValueError: why\n"
    assert re.fullmatch(line, inherited.stderr)


# the units -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["agent", "server"])
def test_unit_is_a_watched_notify_service_that_restarts_on_failure_but_not_on_a_bad_config(role):
    service = {key: values[-1] for key, values in service_section(UNITS[role]).items()}
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main" and service["WatchdogSec"]
    assert service["Restart"] == "on-failure"  # which includes a watchdog timeout
    assert service["RestartPreventExitStatus"] == "2"  # the CLI's exit code for a bad config
    assert service["User"] == "skyfed" and service["ProtectSystem"] == "strict"
    assert re.fullmatch(rf"{INSTALLED_SKYFED} {role} run --config /etc/skyfed/{role}\.toml( --keep-running)?",
                        service["ExecStart"])  # fmt: skip
    # a training child must be possible, and die with the service
    assert not {"KillMode", "TasksMax", "LimitNPROC"} & service.keys()


@pytest.mark.parametrize("role", ["agent", "server", "dashboard"])
def test_unit_raises_the_descriptor_limit_above_systemds_1024(role):
    """1,022 idle connections to the server's metrics endpoint filled a 1,024 table and stalled a round."""
    (limit,) = service_section(UNITS[role])["LimitNOFILE"]
    assert int(limit) >= 8192


def test_agent_unit_reaches_serial_ports_through_dialout_only():
    service = service_section(UNITS["agent"])
    assert service["SupplementaryGroups"] == ["dialout"] and service["DevicePolicy"] == ["closed"]
    assert {"char-ttyACM rw", "char-ttyUSB rw", "char-ttyTHS rw", "char-ttyAMA rw"} <= set(service["DeviceAllow"])


THREADS_PROBE = ("import threadpoolctl, torch; print([p['num_threads'] for p in threadpoolctl.threadpool_info() "
                 "if p['internal_api'] == 'openblas'], torch.get_num_threads())")  # fmt: skip


@pytest.mark.parametrize("role", ["agent", "server"])
def test_unit_runs_numpys_openblas_on_one_thread_and_leaves_pytorchs_threads_alone(tmp_path, role):
    """Spinning OpenBLAS threads made the server's accept path 16x slower under contention (docs/results/scale.md)."""
    _, env = unit_command(role, tmp_path / f"{role}.toml", tmp_path)
    env.pop("OMP_NUM_THREADS", None)  # as under systemd, whatever ran this test
    probe = [sys.executable, "-c", "import numpy; " + THREADS_PROBE]
    under_unit = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    default = {k: v for k, v in env.items() if k != "OPENBLAS_NUM_THREADS"}
    unpinned = subprocess.run(probe, env=default, capture_output=True, text=True, timeout=60, check=True).stdout
    blas, torch_threads = under_unit.rsplit(" ", 1)
    assert blas == "[1]", f"{UNITS[role]}: numpy's OpenBLAS runs {blas} threads; set OPENBLAS_NUM_THREADS=1"
    assert torch_threads == unpinned.rsplit(" ", 1)[1]  # training.threads / the evaluation decide PyTorch's


@pytest.mark.parametrize("role", ["agent", "server", "dashboard"])
def test_systemd_analyze_verify_is_silent(tmp_path, role):
    analyze = systemd_analyze()
    unit = rendered(tmp_path, UNITS[role])
    if role == "agent":  # with the Jetson drop-in, as a Jetson runs it
        (tmp_path / f"{unit.name}.d").mkdir()
        shutil.copy(SYSTEMD / "jetson-gpu.conf", tmp_path / f"{unit.name}.d" / "jetson-gpu.conf")
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    # verify exits 0 on unknown keys and bad values, but says so on stderr
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), result.stderr


@pytest.mark.parametrize("role", ["agent", "server", "dashboard"])
def test_systemd_analyze_security_rates_the_unit_at_most_3(tmp_path, role):
    analyze = systemd_analyze()
    result = subprocess.run([analyze, "security", "--offline=true", str(rendered(tmp_path, UNITS[role]))],
                            capture_output=True, text=True)  # fmt: skip
    level = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert level is not None, result.stdout + result.stderr
    assert float(level[1]) <= 3.0, result.stdout


# the real daemons ------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["agent", "server"])
def test_unit_command_is_ready_only_once_connected_then_pings_reports_and_stops(tmp_path, broker, role):
    topics, configs = federation(tmp_path, broker)
    argv, env = unit_command(role, configs[role], tmp_path / "state")
    broker.stop()  # first with the broker down: alive, not ready
    with NotifySocket() as notify, open(tmp_path / "daemon.log", "wb") as log:
        env.update(NOTIFY_SOCKET=notify.address, WATCHDOG_USEC="1000000")
        process = subprocess.Popen(argv, env=env, stderr=log)
        try:
            notify.wait("EXTEND_TIMEOUT_USEC", "1000000", timeout_s=90)  # the loop turns: keep extending the start
            notify.wait("STATUS", "unreachable")
            assert not notify.received("READY")
            broker.start()
            ready = notify.wait("READY", "1", timeout_s=60)
            time.sleep(2.5)
            pings = [at for at, _ in notify.received("WATCHDOG", since=ready)]
            assert len(pings) >= 3 and min(b - a for a, b in pairwise(pings)) > 0.25  # at half of 1 s
            notify.wait("STATUS", since=ready)
            status = notify.received("STATUS")[-1][1]  # the connection state, or the round and phase
            assert "unreachable" not in status and ("round 1: waiting for agents" in status or role == "agent")
            elapsed = stop(process)
        finally:
            process.kill()
            process.wait()
        assert [value for _, value in notify.received("STOPPING")] == ["1"]
    assert process.returncode == 0 and elapsed < STOP_BOUND_S, (elapsed, (tmp_path / "daemon.log").read_text())
    said = [line for line in (tmp_path / "daemon.log").read_text().splitlines() if "stopped on" in line]
    assert len(said) == 1 and re.search(r"stopped on SIGTERM round=\d+ model_version=\d+$", said[0]), said
    if role == "server":  # the last retained status still goes out when the broker is up
        assert retained(broker, topics.server_status)["state"] == "stopped"
    else:
        assert retained(broker, topics.agent_status("agent-01"))["body"]["state"] == "offline"


@pytest.mark.parametrize("role", ["agent", "server"])
def test_daemon_exits_within_2_s_of_sigterm_while_the_broker_is_gone(tmp_path, broker, role):
    _, configs = federation(tmp_path, broker)
    argv = [sys.executable, "-m", "skyfed", role, "run", "--config", str(configs[role])]
    with NotifySocket() as notify, open(tmp_path / "daemon.log", "wb") as log:
        process = subprocess.Popen(argv, env={**os.environ, "NOTIFY_SOCKET": notify.address}, stderr=log)
        try:
            notify.wait("READY", "1", timeout_s=90)
            broker.kill()
            notify.wait("STATUS", "unreachable")  # reconnecting now: this used to take 6 s to stop
            elapsed = stop(process)
        finally:
            process.kill()
            process.wait()
    assert process.returncode == 0 and elapsed < STOP_BOUND_S, (elapsed, (tmp_path / "daemon.log").read_text())
