"""A GPU agent's settings and a drone's offline rule: ``training.device`` may name a GPU
(``cuda:1``) and one that is not there fails at start; ``training.amp`` runs the detector in fp16 with its
loss scale kept across rounds (``participant.amp``); ``skyfed sim --in-process`` trains where the agents' configs
say; and a detector round, an ONNX export and on-device inference touch no network (no Ultralytics font
or checkpoint download, no onnxruntime telemetry)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.config import load_agent_config
from agent.daemon import EdgeAgent
from agent.device import check_device_present, check_device_spec, device_problem, torch_device
from participant.amp import SCALER_FILE, ScalerStore
from protocol.config import ConfigError
from sim.federation import SimSettings, create_federation
from sim.inprocess import _agents
from tests.fedharness import override_toml

ROOT = Path(__file__).resolve().parent.parent
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ABSENT = f"cuda:{GPUS}"  # the first index this machine does not have

# A detector round, the ONNX export and `skyfed agent infer`'s loading, with every DNS lookup and socket
# connect refused and recorded (a fresh interpreter: Ultralytics and onnxruntime read their settings once).
OFFLINE_ROUND = """
import json, socket, sys
from pathlib import Path
attempts = []
def refuse(*args, **kwargs):
    attempts.append(repr(args)[:160])
    raise OSError("no network on a drone")
socket.getaddrinfo = refuse
socket.socket.connect = lambda self, address: refuse(address)
import torch
from participant.detector import DetectorTrainer
from agent.infer import load_model
from participant.jobs import export_onnx
from models.synthetic_detection import NAMES, write_dataset
from models.weights import to_arrays
from models.zoo import build_model
from protocol.messages import TrainSettings
from tests.fedharness import round_task
root = Path(sys.argv[1])
data = write_dataset(root / "data", train=4, val=2, seed=3, size=64)
settings = TrainSettings(epochs=1, batch_size=4, image_size=64)
task = round_task(model="yolo11n", num_classes=len(NAMES), classes=list(NAMES), train=settings)
arrays = to_arrays(build_model("yolo11n", num_classes=len(NAMES)))
trainer = DetectorTrainer(data, device=torch.device("cpu"), agent_id="agent-01", work_dir=root / "work", amp=True)
trainer.train(arrays, task)
print("export", export_onnx(arrays, task, root / "model.onnx"), file=sys.stderr)
load_model(root / "model.onnx")
print(json.dumps(attempts))
"""


def test_a_detector_round_an_onnx_export_and_inference_touch_no_network(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    # as an agent runs: no offline settings of ours, and not under pytest (Ultralytics then mutes its callbacks)
    prefixes = ("YOLO_", "ORT_", "XDG_", "ULTRALYTICS_", "PYTEST_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env |= {"HOME": str(home), "PYTHONPATH": str(ROOT), "ULTRALYTICS_API_KEY": "a-key-would-stream-to-the-platform"}
    done = subprocess.run([sys.executable, "-c", OFFLINE_ROUND, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []  # on main: Arial.ttf looked up on GitHub every round
    telemetry = [p.relative_to(home) for p in home.rglob("*") if "Microsoft" in p.parts and p.is_file()]
    assert telemetry == []  # on main: onnxruntime's device id and event cache for upload
    assert "Exported(" in done.stderr
    assert not (tmp_path / "work" / SCALER_FILE).exists()  # amp on the CPU: an fp32 round, nothing to keep


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", "cuda:1", "cuda:12"])
def test_a_device_may_name_a_gpu_by_index(spec):
    check_device_spec(spec)


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA", "cuda:1,2", "mps", " cpu"])
def test_a_device_that_is_no_device_is_refused_naming_the_key(spec):
    with pytest.raises(ValueError, match=r'training.device must be "auto", "cpu", "cuda" or "cuda:N"'):
        check_device_spec(spec)


def test_a_gpu_that_is_not_there_is_named_with_what_is():
    assert device_problem("cpu", 0) == device_problem("auto", 0) == device_problem("cuda:1", 2) == ""
    assert "sees no CUDA GPU" in device_problem("cuda", 0) and 'training.device = "auto" or "cpu"' in device_problem(
        "cuda", 0
    )
    assert "sees 1 CUDA GPU(s), cuda:0 to cuda:0" in device_problem("cuda:1", 1)
    with pytest.raises(ValueError, match=f'training.device = "{ABSENT}" but PyTorch sees'):
        torch_device(ABSENT)
    assert torch_device("cpu") == torch.device("cpu")
    assert torch_device("auto").type == ("cuda" if GPUS else "cpu")


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    settings = SimSettings(agents=2, rounds=1, in_process=True)
    return create_federation(tmp_path_factory.mktemp("fed"), settings, ("127.0.0.1", 1))


def test_an_agent_told_to_train_on_a_missing_gpu_fails_at_start(layout, tmp_path):
    path = layout.agent_configs["agent-01"]
    original = path.read_text()
    try:
        override_toml(path, training={"device": ABSENT})
        config = load_agent_config(path)  # the form is right; only this machine lacks the GPU
        with pytest.raises(ValueError, match=f'"{ABSENT}" but PyTorch sees'):
            check_device_present(config.training.device)  # in a child: the daemon stays free of PyTorch
        with pytest.raises(ValueError, match=f'"{ABSENT}" but PyTorch sees'):
            EdgeAgent(config)  # skyfed agent run: "cannot start: ...", exit 2 (protocol.daemon.run_daemon)
    finally:
        path.write_text(original)


def test_in_process_sim_trains_on_the_agents_device(layout):
    """``skyfed sim --in-process`` builds each agent's trainer on its ``training.device`` (main: always the CPU)."""
    configs = dict(layout.agent_configs)
    original = {name: path.read_text() for name, path in configs.items()}
    try:
        override_toml(configs["agent-01"], training={"device": "cpu"})
        assert all(agent.trainer.device == torch.device("cpu") for agent in _agents(configs, SimSettings()))
        override_toml(configs["agent-02"], training={"device": ABSENT})
        with pytest.raises(ValueError, match=f'"{ABSENT}" but PyTorch sees'):
            _agents(configs, SimSettings())
    finally:
        for name, text in original.items():
            configs[name].write_text(text)


@pytest.mark.parametrize(
    "training, message",
    [
        ({"amp": True}, 'training.amp = true is for trainer = "detector" on a CUDA device'),
        ({"amp": "yes"}, "training.amp has the wrong type"),
        ({"device": "cuda:x"}, 'training.device must be "auto", "cpu", "cuda" or "cuda:N"'),
    ],
)
def test_amp_and_device_mistakes_fail_at_start_naming_the_key(layout, training, message):
    path = layout.agent_configs["agent-01"]
    original = path.read_text()
    try:
        override_toml(path, training=training)
        with pytest.raises(ConfigError, match=message):
            load_agent_config(path)
    finally:
        path.write_text(original)


def test_the_loss_scale_is_kept_for_the_same_model_only(tmp_path):
    store = ScalerStore(tmp_path)
    state = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
             "_growth_tracker": 37}  # fmt: skip
    assert store.start("yolo11n") == {}
    store.keep("yolo11n", state)
    assert store.start("yolo11n") == state and store.start("yolov8n") == {}
    store.keep("yolo11n", state | {"scale": float("inf")})  # a diverged scale is not carried on
    assert store.start("yolo11n") == {} and not (tmp_path / SCALER_FILE).exists()
    (tmp_path / SCALER_FILE).write_text("{not json")
    assert store.start("yolo11n") == {}
    (tmp_path / SCALER_FILE).write_text(json.dumps({"model": "yolo11n", "state": state | {"scale": -1}}))
    assert store.start("yolo11n") == {}
