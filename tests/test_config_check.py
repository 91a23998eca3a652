"""``skyfed server|agent check`` and the daemons' start: a bad config fails in a second, naming the key and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from sim.broker import free_port
from sim.federation import SimSettings, create_federation
from skyfed import main
from tests.fedharness import override_toml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def federation(tmp_path):
    return create_federation(tmp_path / "fed", SimSettings(agents=1, rounds=1, federation="fleet"),
                             ("127.0.0.1", free_port()))  # fmt: skip


def _file_in_the_way(tmp_path: Path) -> Path:
    """A state_dir nobody can create, even as root: its parent is a regular file."""
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "state"


def test_check_says_ok_with_a_summary(federation, capsys):
    assert main(["server", "check", "--config", str(federation.server_config)]) == 0
    assert main(["agent", "check", "--config", str(federation.agent_configs["agent-01"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok: ") and "federation=fleet" in out[0] and "eval_data=" in out[0]
    assert out[1].startswith("ok: ") and "id=agent-01" in out[1]


def test_an_unwritable_state_dir_names_the_key_and_the_fix(federation, tmp_path, capsys):
    bad = str(_file_in_the_way(tmp_path))
    override_toml(federation.server_config, server={"state_dir": bad})
    override_toml(federation.agent_configs["agent-01"], agent={"state_dir": bad})
    assert main(["server", "check", "--config", str(federation.server_config)]) == 2
    assert main(["agent", "check", "--config", str(federation.agent_configs["agent-01"])]) == 2
    err = capsys.readouterr().err
    assert f"server.state_dir = '{bad}': cannot write there (Not a directory)" in err and "install -d" in err
    assert f"agent.state_dir = '{bad}'" in err


def test_a_missing_eval_set_is_a_warning(federation, capsys):
    text = federation.server_config.read_text().replace('eval_data = "test.npz"\n', "")
    federation.server_config.write_text(text)
    assert main(["server", "check", "--config", str(federation.server_config)]) == 0
    assert "warning: server.eval_data is not set" in capsys.readouterr().out


def _skyfed(*args: str) -> subprocess.Popen:
    code = "import sys; from skyfed import main; rc = main(sys.argv[1:]); print('torch' in sys.modules); sys.exit(rc)"
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_a_config_error_comes_before_pytorch_is_imported(federation):
    override_toml(federation.server_config, server={"rounds": -1})
    override_toml(federation.agent_configs["agent-01"], agent={"status_interval_s": "often"})
    for role, config in (("server", federation.server_config), ("agent", federation.agent_configs["agent-01"])):
        out, err = _skyfed(role, "run", "--config", str(config)).communicate(timeout=60)
        assert out.strip() == "False", f"{role}: PyTorch imported before the config error ({err})"
        assert "cannot start" in err


def test_the_server_warns_at_start_when_nothing_evaluates_rounds(federation):
    text = federation.server_config.read_text().replace('eval_data = "test.npz"\n', "")
    federation.server_config.write_text(text)
    proc = _skyfed("server", "run", "--config", str(federation.server_config))
    try:
        first = proc.stderr.readline()  # the broker is not there: the daemon keeps trying; the warning comes first
    finally:
        proc.kill()
        proc.wait()
    assert "WARNING skyfed.server: server.eval_data is not set" in first


def test_check_makes_nothing(federation, tmp_path, capsys):
    """``check`` starts nothing and leaves no folder behind (as root it would otherwise make a state_dir the
    service user cannot write); a state_dir that cannot be made is still refused."""
    fresh = tmp_path / "not" / "yet"
    override_toml(federation.server_config, server={"state_dir": str(fresh)})
    override_toml(federation.agent_configs["agent-01"], agent={"state_dir": str(fresh)})
    assert main(["server", "check", "--config", str(federation.server_config)]) == 0
    assert main(["agent", "check", "--config", str(federation.agent_configs["agent-01"])]) == 0
    assert not (tmp_path / "not").exists()
    override_toml(federation.server_config, server={"state_dir": str(_file_in_the_way(tmp_path))})
    assert main(["server", "check", "--config", str(federation.server_config)]) == 2
    assert "server.state_dir" in capsys.readouterr().err


def test_a_folder_as_config_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main(["server", "check", "--config", str(tmp_path)]) == 2
    assert main(["agent", "check", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("cannot read this config file (Is a directory)") == 2, err


def test_agent_check_reads_the_keys_and_the_data_as_the_daemon_does(federation, tmp_path, capsys):
    """Found by the operator review: check said ok for a public key as keys.identity, a private key as
    keys.server, a data file that is not an .npz, and a negative status interval; the agent then failed."""
    config = federation.agent_configs["agent-01"]
    original = config.read_text()
    keys = tomllib.loads(original)["keys"]
    identity, server = (config.parent / keys["identity"]).resolve(), (config.parent / keys["server"]).resolve()
    (tmp_path / "data.csv").write_text("x,y\n1,2\n")
    cases = [
        ({"keys": {"identity": str(identity.with_suffix(".pub"))}}, "keys.identity = ", "is a public key"),
        ({"keys": {"server": str(identity)}}, "keys.server = ", "is a PRIVATE key"),
        ({"keys": {"identity": str(server)}}, "keys.identity = ", "is a public key"),
        ({"agent": {"data": str(tmp_path / "data.csv")}}, "agent.data = ", "reads an .npz file with arrays x and y"),
        ({"agent": {"status_interval_s": -5}}, "agent.status_interval_s must be > 0 seconds", ""),
    ]
    for change, key, fix in cases:
        config.write_text(original)
        override_toml(config, **change)
        assert main(["agent", "check", "--config", str(config)]) == 2, change
        err = capsys.readouterr().err
        assert key in err and fix in err, err
    config.write_text(original)
    assert main(["agent", "check", "--config", str(config)]) == 0


def test_a_key_in_the_wrong_table_is_named_with_the_table_it_belongs_in(federation, capsys):
    override_toml(federation.agent_configs["agent-01"], agent={"worker": "warm"})
    override_toml(federation.server_config, server={"deadline_s": 30})
    assert main(["agent", "check", "--config", str(federation.agent_configs["agent-01"])]) == 2
    assert main(["server", "check", "--config", str(federation.server_config)]) == 2
    err = capsys.readouterr().err
    assert "agent.worker belongs in [training]: move `worker = …` there" in err
    assert "server.deadline_s belongs in [rounds]" in err


def test_a_command_builds_only_its_part_of_the_parser_and_help_lists_every_command():
    """``skyfed server check`` imports no other package's command line (the check's start-up time); help does."""
    import skyfed

    assert skyfed.first_command(["--log-level", "debug", "server", "check"]) == "server"
    assert skyfed.first_command(["-h", "server"]) is None and skyfed.first_command([]) is None
    built = skyfed.build_parser("server")._subparsers._group_actions[0].choices
    assert "server" in built and "sim" not in built and "provision" not in built
    everything = skyfed.build_parser()._subparsers._group_actions[0].choices
    assert {"agent", "server", "monitor", "dashboard", "sim", "data", "keys", "certs", "provision"} <= set(everything)
