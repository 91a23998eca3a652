"""Deployment files: the example configs load with the real loaders (the systemd units: test_systemd.py)."""

import shutil
from pathlib import Path

import pytest

from agent.config import load_agent_config
from broker_server.config import load_server_config
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    return create_federation(tmp_path_factory.mktemp("fed"), SimSettings(agents=1, rounds=1), ("127.0.0.1", 1))


def test_example_server_config_is_valid_apart_from_its_paths(tmp_path, layout):
    path = tmp_path / "server.toml"
    shutil.copy(DEPLOY / "examples" / "server.toml", path)
    server_dir = layout.server_config.parent
    override_toml(
        path,
        server={"state_dir": str(tmp_path / "state"), "eval_data": str(server_dir / "test.npz")},
        keys={"identity": str(server_dir / "server.key"), "enrolled": str(server_dir / "enrolled")},
    )
    config = load_server_config(path)
    assert "name" not in config.strategy and config.rounds.quorum <= config.rounds.min_agents  # the default
    assert config.bounds.clip == "adaptive" and config.bounds.sample_multiple > 0  # bounded influence by default


def test_example_agent_config_is_valid_apart_from_its_paths(tmp_path, layout):
    path = tmp_path / "agent.toml"
    shutil.copy(DEPLOY / "examples" / "agent.toml", path)
    agent_dir = layout.agent_configs["agent-01"].parent
    override_toml(
        path,
        agent={"id": "agent-01", "data": str(agent_dir / "data.npz")},
        keys={"identity": str(agent_dir / "agent-01.key"), "server": str(agent_dir / "server.pub")},
    )
    assert load_agent_config(path).broker.reconnect_max_s == 30.0
