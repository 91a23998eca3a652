"""The operator's own model (``model = "package.module:build"``) and data loader (``data_loader =
"package.module:load"``): a real federation trains them, bad values fail at start naming the key, and an
agent never builds a model it was not configured for (docs/own-model.md)."""

from __future__ import annotations

import sys
import textwrap
import threading

import numpy as np
import pytest

from agent.config import load_agent_config
from agent.profile import DataProfile, read_start_files
from agent.training_child import Worker
from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from models.datasets import Dataset, load_npz
from models.serialization import save_file
from participant.classifier import ClassifierTrainer
from participant.declined import TrainingDeclined
from protocol.config import ConfigError
from sim.federation import SimSettings, create_federation
from tests.fedharness import Federation, override_toml, round_task, wait_until

MODEL = '''
"""A tiny MLP on 8x8 digits: the operator's own model."""
from torch import nn

INPUT_SHAPE = (1, 8, 8)
HIDDEN = 16


def build(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, num_classes))


def not_a_module(num_classes):
    return {"fc": num_classes}


NOT_CALLABLE = 3
'''

LOADER = '''
"""Reads a CSV of label,pixel0..pixel63 rows: data that is not an .npz."""
import numpy as np


def load(path):
    rows = np.loadtxt(path, delimiter=",", ndmin=2)
    return rows[:, 1:].reshape(-1, 1, 8, 8), rows[:, 0].astype(np.int64)


def floats_as_labels(path):
    x, y = load(path)
    return x, y.astype(np.float32)


def nothing(path):
    return np.zeros((0, 1, 8, 8), np.float32), np.zeros(0, np.int64)


def a_list(path):
    return [1, 2, 3]
'''


@pytest.fixture
def own_code(tmp_path, monkeypatch):
    """``ownfed_model`` and ``ownfed_data`` importable from a folder on sys.path, fresh for each test."""
    folder = tmp_path / "operator_code"
    folder.mkdir()
    (folder / "ownfed_model.py").write_text(textwrap.dedent(MODEL))
    (folder / "ownfed_data.py").write_text(textwrap.dedent(LOADER))
    monkeypatch.syspath_prepend(str(folder))
    for name in ("ownfed_model", "ownfed_data"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield folder
    for name in ("ownfed_model", "ownfed_data"):
        sys.modules.pop(name, None)


def as_csv(layout) -> None:  # noqa: ANN001 - a FederationLayout
    """Every agent's .npz data rewritten as CSV, read by ``ownfed_data:load``."""
    for config in layout.agent_configs.values():
        for key, name in (("data", "data.npz"), ("test_data", "test.npz")):
            data = load_npz(config.parent / name)
            rows = np.column_stack([data.y, data.x.reshape(len(data), -1)])
            np.savetxt(config.parent / f"{key}.csv", rows, delimiter=",", fmt="%.6g")
            (config.parent / name).unlink()
        override_toml(config, agent={"data": "data.csv", "test_data": "test_data.csv",
                                     "data_loader": "ownfed_data:load"})  # fmt: skip


def test_a_federation_trains_the_operators_own_model_on_data_from_its_own_loader(tmp_path, broker, own_code):
    fed = Federation(tmp_path, broker, rounds=2, agents=2, model="ownfed_model:build", edit=as_csv)
    server = Aggregator(load_server_config(fed.layout.server_config))
    fed.run(server)
    metrics = fed.metrics()
    assert [m.round for m in metrics] == [1, 2]
    assert all(sorted(m.accepted) == ["agent-01", "agent-02"] for m in metrics)
    assert set(server.engine.global_arrays) == {"1.weight", "1.bias", "3.weight", "3.bias"}
    assert server.engine.global_arrays["1.weight"].shape == (16, 64)
    assert metrics[-1].eval["accuracy"] > 0.2  # it learned (chance is 0.1)


def test_an_agent_whose_own_model_has_another_layout_declines_naming_the_tensor(tmp_path, broker, own_code):
    fed = Federation(tmp_path, broker, rounds=1, agents=2, model="ownfed_model:build")
    server = Aggregator(load_server_config(fed.layout.server_config))  # its global model: HIDDEN = 16
    import ownfed_model

    ownfed_model.HIDDEN = 32  # the agents' copy of the module builds another layout
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    fed.start_agents()
    try:
        wait_until(lambda: all("layout-mismatch" in a.detail for a in fed.agents), 60, "both agents declined")
    finally:
        fed.close()
    assert all("1.weight" in a.detail and "(16, 64)" in a.detail and "(32, 64)" in a.detail for a in fed.agents)
    assert fed.metrics() == []  # nothing was averaged


def test_an_agent_refuses_a_task_naming_a_model_its_config_does_not(tmp_path, broker, own_code):
    def unset_model(layout) -> None:  # noqa: ANN001
        override_toml(layout.agent_configs["agent-02"], training={"model": "digits_cnn"})

    fed = Federation(tmp_path, broker, rounds=1, agents=2, model="ownfed_model:build", edit=unset_model)
    server = Aggregator(load_server_config(fed.layout.server_config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    fed.start_agents()
    try:
        wait_until(lambda: fed.agents[1].refusal != "", 30, "agent-02 refused the task")
    finally:
        fed.close()
    assert fed.agents[1].refusal == ("model-mismatch: the round task names ownfed_model:build, this agent's config "
                                     "digits_cnn")  # fmt: skip


def test_a_task_naming_code_is_never_imported_by_an_agent_without_that_model_in_its_config(tmp_path, own_code):
    (own_code / "planted.py").write_text("raise SystemExit('imported code from a round task')\n")
    task = round_task(model="planted:build")
    assert DataProfile("classify", 10).refusal(task).startswith("model-mismatch: the round task names the custom "
                                                                "model planted:build")  # fmt: skip
    assert DataProfile("classify", 10, model="ownfed_model:build").refusal(task).startswith("model-mismatch")
    x = np.zeros((4, 1, 8, 8), np.float32)
    trainer = ClassifierTrainer(Dataset(x, np.zeros(4, np.int64)), device="cpu", agent_id="agent-01",
                                work_dir=tmp_path)  # fmt: skip
    with pytest.raises(TrainingDeclined, match="model-mismatch"):
        trainer.train({}, task)
    save_file(tmp_path / "base.safetensors", {"w": np.zeros(2, np.float32)})
    child = Worker(layout(tmp_path / "fed").agent_configs["agent-01"])  # an ONNX export of the task's model
    reply = child.perform({"kind": "export", "dir": str(tmp_path), "task": task.to_dict(), "path": str(tmp_path / "m")})
    assert reply["declined"].startswith("model-mismatch")
    assert "planted" not in sys.modules


def layout(tmp_path, **settings: object):  # noqa: ANN201
    return create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it", **settings), ("127.0.0.1", 1))


@pytest.mark.parametrize(("model", "says"), [
    ("ownfed_model.build", "server.model 'ownfed_model.build' is unknown"),
    ("ownfed model:build", 'expected "package.module:function"'),
    ("no_such_module:build", "module 'no_such_module' cannot be imported"),
    ("ownfed_model:missing", "has no attribute 'missing'"),
    ("ownfed_model:NOT_CALLABLE", "is a int, not a function"),
    ("ownfed_model:not_a_module", "returned a dict, not a torch.nn.Module"),
])  # fmt: skip
def test_a_bad_server_model_fails_at_start_naming_the_key(tmp_path, own_code, model, says):
    fed = layout(tmp_path)
    override_toml(fed.server_config, server={"model": model})
    with pytest.raises(ConfigError, match="server.model") as caught:
        load_server_config(fed.server_config)
    assert says in str(caught.value)


def test_a_model_module_without_its_input_shape_fails_at_start(tmp_path, own_code):
    (own_code / "ownfed_model.py").write_text(textwrap.dedent(MODEL).replace("INPUT_SHAPE = (1, 8, 8)", ""))
    fed = layout(tmp_path)
    override_toml(fed.server_config, server={"model": "ownfed_model:build"})
    with pytest.raises(ConfigError, match=r"server.model .*INPUT_SHAPE = \(1, 8, 8\)"):
        load_server_config(fed.server_config)


@pytest.mark.parametrize(("loader", "says"), [
    ("ownfed_data:floats_as_labels", "y must hold integer class labels, got float32"),
    ("ownfed_data:nothing", "returned no samples"),
    ("ownfed_data:a_list", "returned a list; return (x, y)"),
    ("ownfed_data:gone", "has no attribute 'gone'"),
])  # fmt: skip
def test_a_bad_data_loader_fails_at_start_naming_the_key(tmp_path, own_code, loader, says):
    fed = layout(tmp_path)
    as_csv(fed)
    config_path = fed.agent_configs["agent-01"]
    override_toml(config_path, agent={"data_loader": loader})
    with pytest.raises(ConfigError, match="agent.data_loader") as caught:
        read_start_files(load_agent_config(config_path))
    assert says in str(caught.value)


def test_an_agent_model_that_does_not_take_its_data_fails_at_start(tmp_path, own_code):
    (own_code / "ownfed_model.py").write_text(textwrap.dedent(MODEL).replace("(1, 8, 8)", "(1, 64)"))
    fed = layout(tmp_path)
    config_path = fed.agent_configs["agent-01"]
    override_toml(config_path, training={"model": "ownfed_model:build"})
    with pytest.raises(ConfigError, match=r"agent.data holds samples of shape \(1, 8, 8\), training.model "):
        read_start_files(load_agent_config(config_path))
    override_toml(config_path, training={"model": "ownfed_model:nope"})
    with pytest.raises(ConfigError, match="training.model = 'ownfed_model:nope': module 'ownfed_model' has no"):
        read_start_files(load_agent_config(config_path))


def test_sim_model_flag_names_the_flag_when_the_builder_is_bad(own_code):
    with pytest.raises(ValueError, match="--model = 'ownfed_model:not_a_module': returned a dict"):
        SimSettings(agents=1, rounds=1, model="ownfed_model:not_a_module")
    assert SimSettings(agents=1, rounds=1, model="ownfed_model:build").model == "ownfed_model:build"


def test_a_trainer_builds_the_operators_own_model_afresh_each_round(tmp_path, own_code):
    """Only zoo models are kept between rounds: an own model may hold state outside its state_dict."""
    from ownfed_model import build

    train = Dataset(np.random.default_rng(0).random((8, 1, 8, 8), dtype=np.float32), np.arange(8) % 10)
    trainer = ClassifierTrainer(train, device="cpu", agent_id="agent-01", work_dir=tmp_path, model="ownfed_model:build")
    start = {name: t.detach().numpy().copy() for name, t in build(10).state_dict().items()}
    trainer.train(start, round_task(model="ownfed_model:build"))
    assert trainer._spare == {}
