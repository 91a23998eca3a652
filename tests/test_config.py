"""Config files: a bad key or value stops the daemon at start with a message naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import load_agent_config
from broker_server.config import load_server_config
from protocol.config import ConfigError
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    return create_federation(tmp_path_factory.mktemp("fed"), SimSettings(agents=1, rounds=1), ("127.0.0.1", 1))


def test_generated_configs_load(layout):
    assert load_server_config(layout.server_config).rounds.min_agents == 1
    assert load_agent_config(layout.agent_configs["agent-01"]).agent.id == "agent-01"


@pytest.mark.parametrize(
    "tables, message",
    [
        ({"rounds": {"quorom": 1}}, "rounds.quorom is not a known key; did you mean 'quorum'"),
        ({"rounds": {"fraction": 1.5}}, "rounds.fraction must be in"),
        ({"server": {"rounds": "three"}}, "server.rounds has the wrong type"),
        ({"server": {"model": "resnet"}}, "server.model 'resnet' is unknown"),
        ({"server": {"federation": "a/b"}}, "server.federation 'a/b' is not a valid name"),
        ({"strategy": {"name": "fedmagic"}}, "strategy.name 'fedmagic' is unknown"),
        ({"broker": {"port": 70000}}, "broker.port must be 1-65535"),
        ({"keys": {"enrolled": "nowhere"}}, "keys.enrolled = 'nowhere': enrolled-agents folder not found"),
        ({"limits": {"max_chunks": 0}}, "max_chunks must be >= 1"),
        ({"extra": {"x": 1}}, "unknown table [extra]"),
        ({"keys": {"rotate_every_rounds": -1}}, "keys.rotate_every_rounds must be >= 0"),
        ({"broker": {"tls": {"ca_certs": "ca.crt"}}}, "broker.tls.ca_certs = 'ca.crt': CA certificate not found"),
        # keys the server never reads: on main silently ignored (the strategy overwrote them, a classifier ignored it)
        ({"training": {"recipes": []}}, "training.recipes is not used in server.toml: the strategy sets them"),
        ({"training": {"image_size": 320}}, "training.image_size is not used with classifier server.model digits_cnn"),
    ],
)
def test_bad_server_config_names_the_key(tmp_path, layout, tables, message):
    path = tmp_path / "server.toml"
    path.write_text(layout.server_config.read_text())
    for name in ("server.key", "enrolled", "test.npz"):
        (tmp_path / name).symlink_to(layout.server_config.parent / name)
    override_toml(path, **tables)
    with pytest.raises(ConfigError) as err:
        load_server_config(path)
    assert message in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(
    "tables, message",
    [
        ({"agent": {"id": "bad id"}}, "agent.id 'bad id' is not a valid name"),
        ({"agent": {"data": "missing.npz"}}, "agent.data = 'missing.npz': training data not found"),
        ({"agent": {"test_data": "gone.npz"}}, "agent.test_data = 'gone.npz': local test split not found"),
        ({"agent": {"data": "missing.npz"}}, "skyfed data digits AGENT... --out DIR writes example ones"),  # the fix
        ({"keys": {"identity": "gone.key"}}, "agent key file not found at"),
        ({"keys": {"identity": "gone.key"}}, "(skyfed provision puts it in DIR/agents/<id>/, a peer's in DIR/peers/"),
        ({"training": {"trainer": "detector"}}, 'agent.test_data (a local test split .npz) is for training.trainer'),
        ({"training": {"device": "tpu"}}, 'training.device must be "auto", "cpu", "cuda" or "cuda:N"'),
        ({"broker": {"protocol": "4"}}, 'broker.protocol must be "3.1.1" or "5"'),
        ({"training": {"warm_idle_s": 30.0}}, 'training.warm_idle_s is for training.worker = "adaptive" (how long an '
                                              'idle child stays); worker = "warm" never reads it: remove it'),
    ],
)
def test_bad_agent_config_names_the_key(tmp_path, layout, tables, message):
    source = layout.agent_configs["agent-01"]
    path = tmp_path / "agent.toml"
    path.write_text(source.read_text())
    for name in ("agent-01.key", "server.pub", "data.npz", "test.npz"):
        (tmp_path / name).symlink_to(source.parent / name)
    override_toml(path, **tables)
    with pytest.raises(ConfigError) as err:
        load_agent_config(path)
    assert message in str(err.value)


def test_not_toml_is_refused_with_the_file_name(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text("[server\nfederation = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_server_config(path)


def test_daemon_exits_2_at_start_naming_the_key(tmp_path, layout):
    path = tmp_path / "server.toml"
    path.write_text(layout.server_config.read_text())
    override_toml(path, rounds={"deadline_s": -1})
    result = subprocess.run(
        [sys.executable, "-m", "skyfed", "server", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("rounds.deadline_s must be > 0") == 1, result.stderr  # said once
