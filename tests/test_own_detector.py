"""The operator's own detector, named by its file: an Ultralytics model ``.yaml`` (an architecture) or a ``.pt``
checkpoint (an architecture and the server's start weights), the same absolute path in server.toml and every
agent.toml. Only a file the agent's own config names is ever built (a ``.pt`` is a pickle)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import ultralytics

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from models.own import model_refusal
from models.synthetic_detection import NAMES
from models.tasks import is_model_file, task_of
from models.weights import to_arrays
from models.zoo import build_model
from protocol.config import ConfigError
from tests.fedharness import Federation, override_toml

SIZE = 64
YOLOV8 = Path(ultralytics.__file__).parent / "cfg" / "models" / "v8" / "yolov8.yaml"


@pytest.fixture
def narrow_yaml(tmp_path) -> Path:
    """Ultralytics' yolov8 with a scale of its own: half yolov8n's width, so its tensors are not any zoo model's."""
    text = re.sub(r"^  n: \[.*\]", "  n: [0.33, 0.125, 1024]", YOLOV8.read_text(), count=1, flags=re.MULTILINE)
    path = tmp_path / "models" / "narrow-yolov8.yaml"
    path.parent.mkdir()
    path.write_text(text)
    return path


def test_a_model_file_is_a_detector_and_a_task_naming_one_is_refused_unless_the_agent_names_it():
    assert task_of("/etc/skyfed/models/drone.yaml") == "detect" and task_of("/srv/m.pt") == "detect"
    assert not is_model_file("drone.yaml")  # relative: it would differ between the server and a device
    assert model_refusal("/tmp/evil.pt", "").startswith("model-mismatch")  # a pickle named only by a round task
    assert model_refusal("/a/m.yaml", "/b/m.yaml").startswith("model-mismatch")
    assert model_refusal("/a/m.yaml", "/a/m.yaml") == ""


def test_an_own_yaml_builds_its_own_architecture(narrow_yaml):
    ours, zoo = build_model(str(narrow_yaml), 5).state_dict(), build_model("yolov8n", 5).state_dict()
    assert set(ours) == set(zoo)  # the same layers, at half the width
    assert ours["model.0.conv.weight"].shape[0] * 2 == zoo["model.0.conv.weight"].shape[0]


@pytest.mark.timeout(300)
def test_a_federation_trains_the_operators_own_yolo_yaml(tmp_path, broker, narrow_yaml):
    def own_model(layout) -> None:  # noqa: ANN001 - the same file in the server's and every agent's config
        override_toml(layout.server_config, server={"model": str(narrow_yaml)})
        for config in layout.agent_configs.values():
            override_toml(config, training={"model": str(narrow_yaml)})

    fed = Federation(tmp_path / "fed", broker, rounds=1, agents=2, task="detect", images_per_agent=8, image_size=SIZE,
                     batch_size=4, strategy={"name": "fedavg"}, edit=own_model)  # fmt: skip
    server = Aggregator(load_server_config(fed.layout.server_config))
    fed.run(server, timeout_s=240)
    (metrics,) = fed.metrics()
    assert metrics.outcome == "committed" and sorted(metrics.accepted) == ["agent-01", "agent-02"], metrics
    expected = build_model(str(narrow_yaml), len(NAMES)).state_dict()
    assert {n: a.shape for n, a in server.engine.global_arrays.items()} == {n: tuple(t.shape) for n, t in
                                                                           expected.items()}  # fmt: skip


def test_an_own_checkpoint_is_the_architecture_and_the_start_weights(tmp_path, broker, narrow_yaml):
    torch.manual_seed(11)
    model = build_model(str(narrow_yaml), len(NAMES))
    checkpoint = tmp_path / "models" / "narrow.pt"
    torch.save({"model": model.half()}, checkpoint)  # as Ultralytics stores it: fp16
    fed = Federation(tmp_path / "fed", broker, rounds=1, agents=1, task="detect", images_per_agent=4, image_size=SIZE)
    override_toml(fed.layout.server_config, server={"model": str(checkpoint)})
    server = Aggregator(load_server_config(fed.layout.server_config))
    expected = to_arrays(model.float())
    assert set(server.engine.global_arrays) == set(expected)
    assert all(np.array_equal(server.engine.global_arrays[n], expected[n]) for n in expected)
    fed.close()


def test_a_missing_or_unbuildable_model_file_fails_at_start_naming_the_key(tmp_path, broker):
    fed = Federation(tmp_path / "fed", broker, rounds=1, agents=1, task="detect", images_per_agent=4, image_size=SIZE)
    override_toml(fed.layout.server_config, server={"model": str(tmp_path / "gone.yaml")})
    with pytest.raises(ConfigError, match=r"server\.model = .*gone\.yaml.*no such file"):
        load_server_config(fed.layout.server_config)
    (tmp_path / "junk.yaml").write_text("backbone: nonsense\n")
    override_toml(fed.layout.server_config, server={"model": str(tmp_path / "junk.yaml")})
    with pytest.raises(ConfigError, match=r"server\.model = .*junk\.yaml.*Ultralytics cannot build"):
        load_server_config(fed.layout.server_config)
    from agent.config import load_agent_config

    (agent_config,) = fed.layout.agent_configs.values()
    override_toml(agent_config, training={"model": str(tmp_path / "gone.yaml")})
    with pytest.raises(ConfigError, match=r"training\.model = .*gone\.yaml.*no such file on this device"):
        load_agent_config(agent_config)
    fed.close()
