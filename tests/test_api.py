"""``skyfed.api``: the docs' example runs as written, a server and two agents on threads of this process finish a
round over a real broker and ``read_metrics`` returns it, bad configs raise ``ConfigError`` naming the key, and the
``skyfed`` command (``python -m skyfed``, the console script, the wheel's entry point) is what it was."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agent.peer.rounds import read_metrics as read_peer_metrics
from common.lock import StateDirInUse
from skyfed import api
from tests.fedharness import override_toml

ROOT = Path(__file__).resolve().parent.parent
QUICK = {"agents": 2, "rounds": 1, "epochs": 1, "deadline_s": 120.0, "federation": "it"}


def env_with_this_checkout() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture
def layout(tmp_path):
    """A federation's files for a broker nobody listens on: enough to load, not to run."""
    return api.write_federation(tmp_path / "fed", "127.0.0.1:9", **QUICK)


# --- the example in docs/ ------------------------------------------------------------------------------
@pytest.mark.integration
def test_the_docs_example_runs_as_written(tmp_path):
    """``python docs/api_example.py OUT``, exactly as a reader runs it (it starts its own brokers)."""
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "api_example.py"), str(tmp_path)], cwd=tmp_path,
                          env=env_with_this_checkout(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run_federation: 1 round(s)" in done.stdout
    assert "round 1: committed" in done.stdout and "updates accepted 2/2 rejected 0" in done.stdout
    assert (tmp_path / "sim" / "metrics.jsonl").exists() and (tmp_path / "sim" / "global_model.safetensors").exists()


# --- the daemons on threads ----------------------------------------------------------------------------
@pytest.mark.integration
def test_a_server_and_two_agents_finish_a_round_and_read_metrics_returns_it(broker, tmp_path):
    layout = api.write_federation(tmp_path / "fed", broker.address, **QUICK)
    first, second = layout.agent_configs.values()
    with api.Agent(first) as one, api.Agent(second) as two:
        with pytest.raises(StateDirInUse, match="agent.state_dir .* in use by another daemon of this process"):
            api.Agent(first).start()  # one daemon per state folder, threads included
        with api.Server(layout.server_config) as server:
            assert server.wait(timeout_s=300), "the round did not finish"
            assert not server.running and one.running and two.running  # the agents wait for the next run
        metrics = api.read_metrics(server.state_dir)
    assert not one.running and not two.running
    assert [(m.round, m.outcome, sorted(m.accepted)) for m in metrics] == [(1, "committed", ["agent-01", "agent-02"])]
    assert metrics[0].eval["accuracy"] > 0.1  # a trained digits model, evaluated on the server's test split
    assert server.metrics() == metrics == api.read_metrics(server.state_dir / "metrics.jsonl")
    again = api.Agent(first).start()  # the stopped agent released its folder
    again.stop()


@pytest.mark.integration
def test_write_federation_in_peer_mode_writes_peers_that_agent_runs_to_their_election(broker, tmp_path):
    """On main ``mode="peer"`` was dropped: it wrote a client federation, whose agents waited for a server."""
    layout = api.write_federation(tmp_path / "fed", broker.address, mode="peer", **QUICK)
    assert not layout.server_config.exists()  # no server in peer mode
    first, second = layout.agent_configs.values()
    with api.Agent(first) as one, api.Agent(second) as two:
        assert one.wait(timeout_s=300) and two.wait(timeout_s=60), "the peers did not finish"
    for config in (first, second):
        state = config.parent / "state"
        assert (state / "best_model.safetensors").exists() and len(read_peer_metrics(state)) == 1
    # what run_federation(mode="peer") returns: on main .metrics was [] without a word, and read_metrics(out) raised
    # "expected schema 'skyfed.metrics/1'"; the peers' rounds are SimResult.peer_rounds
    from sim.peer_run import collect_peer_results

    (tmp_path / "out").mkdir()
    result = collect_peer_results(layout.root, tmp_path / "out", list(layout.agent_configs),
                                  api.SimSettings(mode="peer", **QUICK), 0.0)  # fmt: skip
    assert result.metrics == [] and sorted(line["peer"] for line in result.peer_rounds) == ["agent-01", "agent-02"]
    assert "accuracy" in result.final_eval
    with pytest.raises(ValueError, match="a peer-mode run's metrics, one line per round and peer: .*peer_rounds"):
        api.read_metrics(tmp_path / "out")


def test_read_metrics_of_a_folder_without_any_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl, and not a SkyFed state folder"):
        api.read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such metrics file"):
        api.read_metrics(tmp_path / "metrics.jsonl")


# --- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("daemon", [api.Server, api.Agent])
def test_a_missing_config_raises_config_error_naming_the_path(daemon, tmp_path):
    with pytest.raises(api.ConfigError, match=f"{tmp_path / 'nowhere.toml'}: no such config file"):
        daemon(tmp_path / "nowhere.toml").start()


@pytest.mark.parametrize(("daemon", "table"), [(api.Server, "server"), (api.Agent, "agent")])
def test_a_bad_key_raises_config_error_naming_it_and_starts_nothing(daemon, table, layout):
    path = layout.server_config if daemon is api.Server else layout.agent_configs["agent-01"]
    override_toml(path, **{table: {"colour": "red"}})
    node = daemon(path)
    with pytest.raises(api.ConfigError, match="colour"):
        node.start()
    assert not node.running


def test_an_unknown_setting_is_named_and_a_bad_value_explained(tmp_path):
    with pytest.raises(TypeError, match="unknown SimSettings field.* agent_count; known: .*agents"):
        api.run_federation(agent_count=2, out=tmp_path)
    with pytest.raises(ValueError, match="--agents must be >= 1"):
        api.run_federation(agents=0, out=tmp_path)
    with pytest.raises(ValueError, match="broker must be HOST:PORT"):
        api.write_federation(tmp_path, "localhost")


def test_settings_of_an_in_process_run_can_be_copied_and_changed():
    """``SimSettings`` fills in a deadline an in-process run never reads; a copy (``run_federation(settings,
    rounds=…)``) held that filled value and was refused as if the user had set ``--deadline``."""
    from sim.federation import SimSettings

    settings = SimSettings(agents=3, in_process=True)
    assert api.settings_of(settings, {"rounds": 2}).rounds == 2 and api.settings_of(settings, {}) == settings
    with pytest.raises(ValueError, match="--deadline is not available with --in-process"):
        SimSettings(agents=3, in_process=True, deadline_s=5.0)


# --- the command is what it was ------------------------------------------------------------------------
def test_python_m_skyfed_and_the_console_script_still_run(tmp_path):
    script = Path(sys.executable).parent / "skyfed"  # the installed console script (pip install -e . puts it there)
    commands = [[sys.executable, "-m", "skyfed", "--help"]] + ([[str(script), "--help"]] if script.exists() else [])
    for command in commands:
        done = subprocess.run(command, cwd=tmp_path, env=env_with_this_checkout(), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0 and done.stdout.startswith("usage: skyfed "), command
        assert "provision" in done.stdout and "sim" in done.stdout
    where = subprocess.run([sys.executable, "-c", "import skyfed.api; print(skyfed.api.__file__)"], cwd=tmp_path,
                           env=env_with_this_checkout(), capture_output=True, text=True, check=True)  # fmt: skip
    assert where.stdout.strip() == str(ROOT / "skyfed" / "api.py")


def test_the_wheel_carries_the_package_and_the_console_script(tmp_path):
    source = tmp_path / "source"  # a copy: a build in the checkout would leave build/ and *.egg-info there
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "skyfed", source / "skyfed", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(source)], check=True, capture_output=True,
                   timeout=300)  # fmt: skip
    (wheel,) = tmp_path.glob("skyfed-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"skyfed/__init__.py", "skyfed/__main__.py", "skyfed/api.py"} <= set(names)
    assert "skyfed.py" not in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "skyfed = skyfed:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
