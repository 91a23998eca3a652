"""One daemon per state directory: a second `skyfed server run` / `skyfed agent run` on a folder in use is
refused at start (naming the folder, the holder's PID and the fix), and a holder killed with -9 leaves no
stale lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.config import load_agent_config
from broker_server.config import load_server_config
from common.lock import StateDirInUse, hold_state_dir
from sim.federation import SimSettings, create_federation

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
HOLD = (
    "import sys, time; from pathlib import Path; from common.lock import hold_state_dir; "
    "hold_state_dir(Path(sys.argv[1]), sys.argv[2]); print('held', flush=True); time.sleep(120)"
)


def skyfed(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skyfed", *args], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=timeout)  # fmt: skip


def holder(directory: Path, key: str) -> subprocess.Popen:
    """Another process holding ``directory``'s lock (as a running daemon does)."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), key], stdout=subprocess.PIPE,
                               text=True, env=ENV, cwd=ROOT)  # fmt: skip
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


@pytest.fixture
def layout(tmp_path, broker):
    return create_federation(tmp_path / "fed", SimSettings(agents=1, rounds=1, federation="lk"),
                             (broker.host, broker.port))  # fmt: skip


def test_a_second_server_on_a_state_dir_in_use_is_refused_naming_the_holder(layout):
    state_dir = load_server_config(layout.server_config).state_dir
    command = [sys.executable, "-m", "skyfed", "server", "run", "--config", str(layout.server_config)]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (state_dir / "checkpoint" / "state.json").exists():  # it has the folder and wrote its state
            assert first.poll() is None and time.monotonic() < deadline, "the first server did not start"
            time.sleep(0.1)
        second = skyfed("server", "run", "--config", str(layout.server_config))
        assert second.returncode == 2
        line = second.stderr.strip().splitlines()[-1]
        assert f"server.state_dir {state_dir} is in use by process {first.pid}" in line, line
        assert "stop that daemon first, or give this one another server.state_dir" in line
        assert first.poll() is None  # the first one runs on, undisturbed
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)


def test_a_second_agent_is_refused_and_a_killed_holder_leaves_no_stale_lock(layout, tmp_path):
    config_path = layout.agent_configs["agent-01"]
    state_dir = load_agent_config(config_path).state_dir
    held = holder(state_dir, "agent.state_dir")
    try:
        refused = skyfed("agent", "run", "--config", str(config_path))
        assert refused.returncode == 2
        assert f"agent.state_dir {state_dir} is in use by process {held.pid}" in refused.stderr
    finally:
        held.kill()  # SIGKILL: no clean-up runs
        held.wait(10)
    again = holder(state_dir, "agent.state_dir")  # the kernel released it: no stale lock to delete
    again.kill()
    again.wait(10)


def test_the_lock_helper_refuses_a_folder_another_process_holds(tmp_path):
    held = holder(tmp_path / "state", "server.state_dir")
    try:
        with pytest.raises(StateDirInUse, match=f"in use by process {held.pid}"):
            hold_state_dir(tmp_path / "state", "server.state_dir")
    finally:
        held.kill()
        held.wait(10)
    hold_state_dir(tmp_path / "state", "server.state_dir")  # free now; held by this test process from here on
    assert (tmp_path / "state" / "skyfed.lock").read_text().strip() == str(os.getpid())
