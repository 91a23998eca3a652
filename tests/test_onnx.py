"""ONNX export (checked against onnxruntime, atomic) and torch-free on-device inference, CLI included."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

import skyfed
from agent.infer import decode, infer, load_model, nms, preprocess
from broker_server.rounds.onnx_step import ExportOnnx
from models.onnx_export import export_onnx
from models.tasks import ONNX_FORMAT
from models.weights import to_arrays
from models.zoo import build_model, input_shape
from sim.broker import free_port

ROOT = Path(__file__).resolve().parent.parent
DIGITS = [str(i) for i in range(10)]
BOXES = ["car", "person", "boat", "tree"]
YOLO_SHAPE = (3, 96, 96)


def metadata(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    torch.manual_seed(0)
    model = build_model("digits_cnn").eval()
    path = tmp_path_factory.mktemp("cnn") / "digits.onnx"
    report = export_onnx(model, path, task="classify", input_shape=input_shape("digits_cnn"), names=DIGITS)
    return model, path, report


@pytest.fixture(scope="module")
def yolo(tmp_path_factory):
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(0)
    model = DetectionModel("yolo11n.yaml", nc=4, verbose=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path_factory.mktemp("yolo") / "yolo.onnx"
    report = export_onnx(model, path, task="detect", input_shape=YOLO_SHAPE, names=BOXES)
    return model, before, path, report


def write_images(folder: Path, sizes: list[tuple[int, int]], suffix: str = ".png") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate(sizes):
        path = folder / f"img{i}{suffix}"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_cnn_export_matches_and_describes_itself(cnn):
    model, path, report = cnn
    assert report.ok and report.path == path and report.reason == "" and report.max_abs_diff <= 1e-4
    meta = metadata(path)
    assert meta["format"] == ONNX_FORMAT and meta["task"] == "classify"
    assert json.loads(meta["names"]) == DIGITS and json.loads(meta["input_shape"]) == [1, 8, 8]
    x = np.random.default_rng(1).random((5, 1, 8, 8), dtype=np.float32)  # dynamic batch: 5 was never traced
    got = load_model(path).session.run(None, {"images": x})[0]
    np.testing.assert_allclose(got, model(torch.from_numpy(x)).detach().numpy(), atol=1e-4)


def test_yolo_export_is_raw_detect_output_and_leaves_the_model_alone(yolo):
    model, before, path, report = yolo
    assert report.ok and report.max_abs_diff <= 1e-4, report.reason
    meta = metadata(path)
    assert meta["task"] == "detect" and json.loads(meta["names"]) == BOXES
    assert json.loads(meta["input_shape"]) == list(YOLO_SHAPE)
    (output,) = onnx.load(str(path)).graph.output
    assert [d.dim_value for d in output.type.tensor_type.shape.dim] == [1, 4 + 4, 12 * 12 + 6 * 6 + 3 * 3]
    assert model.training and not model.model[-1].export  # the caller's model: same mode, same head, same weights
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class Noisy(torch.nn.Module):
    """Randomness at inference: onnxruntime draws other numbers, so the check must refuse the file."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x.flatten(1))
        return y + torch.randn_like(y)


class Unexportable(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.flatten(1)[:, :3]
        return torch.linalg.eigvalsh(m[:, :, None] * m[:, None, :])  # no ONNX symbolic: the exporter raises


@pytest.mark.parametrize(("model", "words"), [(Noisy(), "differs from PyTorch"), (Unexportable(), "eigvalsh")])
def test_failed_export_publishes_nothing_and_keeps_the_previous_file(tmp_path, model, words):
    path = tmp_path / "global_model.onnx"
    report = export_onnx(model, path, task="classify", input_shape=(1, 8, 8), names=["a", "b", "c"])
    assert not report.ok and report.path is None and words in report.reason
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp file
    path.write_bytes(b"previous good model")
    assert not export_onnx(model, path, task="classify", input_shape=(1, 8, 8), names=["a", "b", "c"]).ok
    assert path.read_bytes() == b"previous good model" and list(tmp_path.iterdir()) == [path]


def test_the_server_step_reports_a_failed_export_and_keeps_the_previous_file(tmp_path, caplog):
    path = tmp_path / "global_model.onnx"
    path.write_bytes(b"previous good model")
    step = ExportOnnx("digits_cnn", ["a", "b", "c"], 8, path)  # a 3-class model, handed a 10-class model's arrays
    detail = step.export(to_arrays(build_model("digits_cnn")), "round=4")
    assert not detail["ok"] and "shape" in detail["reason"] and path.read_bytes() == b"previous good model"
    assert "onnx export failed round=4 reason=" in caplog.text
    good = ExportOnnx("digits_cnn", DIGITS, 8, path).export(to_arrays(build_model("digits_cnn")), "round=5")
    assert good["ok"] and good["max_abs_diff"] <= 1e-4 and metadata(path)["names"] == json.dumps(DIGITS)


def test_detect_needs_an_ultralytics_head(tmp_path):
    report = export_onnx(
        build_model("digits_cnn"), tmp_path / "m.onnx", task="detect", input_shape=(1, 8, 8), names=["a"]
    )
    assert not report.ok and "Detect head" in report.reason and not (tmp_path / "m.onnx").exists()


def test_class_aware_nms_by_hand():
    boxes = np.array(
        [[0, 0, 10, 10], [1, 1, 11, 11], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 5]], dtype=np.float32
    )
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    classes = np.array([0, 0, 1, 0, 0])
    # box 1 vs 0: IoU 81/119 = 0.68 (dropped); box 2 is another class (kept); box 4 vs 0: IoU 50/100 = 0.5
    assert nms(boxes, scores, classes, 0.45).tolist() == [0, 2, 3]
    assert nms(boxes, scores, classes, 0.5).tolist() == [0, 2, 3, 4]  # dropped only when IoU exceeds the threshold
    assert nms(boxes[:0], scores[:0], classes[:0], 0.45).tolist() == []


def test_decode_thresholds_converts_xywh_and_caps():
    pred = np.array(
        [
            [50, 52, 10],  # x centre
            [50, 50, 10],  # y centre
            [20, 20, 4],  # w
            [10, 10, 4],  # h
            [0.9, 0.8, 0.1],  # class 0
            [0.1, 0.2, 0.2],  # class 1
        ],
        dtype=np.float32,
    )
    boxes, scores, classes = decode(pred, conf=0.25, iou=0.45, max_det=300)
    assert boxes.tolist() == [[40, 45, 60, 55]] and scores.tolist() == pytest.approx([0.9]) and classes.tolist() == [0]
    assert len(decode(pred, conf=0.0, iou=0.99, max_det=2)[0]) == 2


def test_infer_classifies_like_pytorch(cnn, tmp_path):
    model, path, _ = cnn
    images = write_images(tmp_path, [(8, 8), (32, 24), (100, 100)])
    results = infer(path, images)
    for image, result in zip(images, results, strict=True):
        x, _ = preprocess(image, (1, 8, 8))
        expected = int(model(torch.from_numpy(x)[None]).argmax())
        assert result["image"] == str(image) and result["class_id"] == expected and result["class"] == DIGITS[expected]
        assert [t["confidence"] for t in result["top5"]] == sorted(
            (t["confidence"] for t in result["top5"]), reverse=True
        )
        assert len(result["top5"]) == 5 and result["top5"][0]["class_id"] == expected and 0 < result["confidence"] <= 1


def test_infer_detects_in_original_pixels(yolo, tmp_path):
    _, _, path, _ = yolo
    (image,) = write_images(tmp_path, [(200, 150)], ".jpg")
    (result,) = infer(path, [image], conf=0.0, max_det=7)
    assert result["image"] == str(image) and len(result["detections"]) == 7
    x, _ = preprocess(image, YOLO_SHAPE)
    raw = load_model(path).session.run(None, {"images": x[None]})[0][0]
    boxes, scores, _ = decode(raw, 0.0, 0.45, 7)
    expected = np.clip(boxes * [200 / 96, 150 / 96, 200 / 96, 150 / 96], 0, [200, 150, 200, 150])
    np.testing.assert_allclose([d["box"] for d in result["detections"]], expected, atol=0.01)
    for d in result["detections"]:
        assert BOXES[d["class_id"]] == d["class"] and 0 <= d["confidence"] <= 1


def test_an_empty_detection_list_says_the_best_score_and_the_threshold(yolo, tmp_path):
    _, _, path, _ = yolo
    (image,) = write_images(tmp_path, [(64, 64)])
    (everything,) = infer(path, [image], conf=0.0, max_det=1)
    best = everything["detections"][0]["confidence"]
    assert everything["best_score"] == best and "hint" not in everything
    (nothing,) = infer(path, [image], conf=min(best + 0.01, 1.0))
    assert nothing["detections"] == [] and nothing["best_score"] == best
    assert nothing["hint"] == f"best score {best:.2f} < --conf {min(best + 0.01, 1.0):g}"


def test_infer_never_imports_torch(cnn, tmp_path):
    (image,) = write_images(tmp_path, [(16, 16)])
    code = (
        "import sys, json; from agent.infer import infer; "
        f"print(json.dumps(infer({str(cnn[1])!r}, [{str(image)!r}]))); "
        "assert 'torch' not in sys.modules and 'ultralytics' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["class"] in DIGITS


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_bad_inputs_name_the_file(cnn, tmp_path):
    with pytest.raises(ValueError, match="missing.onnx: model file not found"):
        infer(tmp_path / "missing.onnx", [])
    foreign = tmp_path / "foreign.onnx"
    torch.onnx.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), str(foreign), dynamo=False)
    with pytest.raises(ValueError, match="foreign.onnx: not a SkyFed ONNX model"):
        infer(foreign, [])
    (tmp_path / "junk.onnx").write_bytes(b"not onnx")
    with pytest.raises(ValueError, match="junk.onnx: not a readable ONNX model"):
        infer(tmp_path / "junk.onnx", [])
    (tmp_path / "broken.png").write_text("not an image")
    with pytest.raises(ValueError, match="broken.png: cannot read image"):
        infer(cnn[1], [tmp_path / "broken.png"])


def agent_toml(folder: Path) -> Path:
    for name in ("data.npz", "agent.key", "server.pub"):
        (folder / name).write_bytes(b"")
    path = folder / "agent.toml"
    path.write_text(
        '[agent]\nid = "drone-01"\nfederation = "fleet"\nstate_dir = "state"\ndata = "data.npz"\n'
        '[broker]\nhost = "127.0.0.1"\n'
        f'port = {free_port()}\n[keys]\nidentity = "agent.key"\nserver = "server.pub"\n'  # never connected to
    )
    return path


def test_cli_infers_a_file_and_a_folder(cnn, tmp_path, capsys):
    images = write_images(tmp_path / "images", [(8, 8), (20, 10), (9, 9)])
    assert skyfed.main(["agent", "infer", "--image", str(images[1]), "--model", str(cnn[1])]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["image"] == str(images[1])
    config = agent_toml(tmp_path)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "global_model.onnx").write_bytes(cnn[1].read_bytes())
    assert skyfed.main(["agent", "infer", "--image", str(tmp_path / "images"), "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["image"] for line in lines] == [str(p) for p in sorted(images)]


def test_cli_bad_input_is_exit_2_with_one_line(tmp_path, capsys):
    (image,) = write_images(tmp_path, [(8, 8)])
    config = agent_toml(tmp_path)
    assert skyfed.main(["agent", "infer", "--image", str(image), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "global_model.onnx: model file not found" in err and err.count("\n") == 1
    assert skyfed.main(["agent", "infer", "--image", str(image)]) == 2
    assert "give --model PATH, or --config" in capsys.readouterr().err
    assert skyfed.main(["agent", "infer", "--image", str(tmp_path / "none.png"), "--model", "m.onnx"]) == 2
    assert "none.png: image not found" in capsys.readouterr().err


def test_the_agents_onnx_export_runs_after_its_update_is_sent(tmp_path, broker, monkeypatch):
    """The on-board export (0.7 s for the digits CNN on this machine, more on a Jetson) is off the round's
    critical path: the round closes on both agents' updates, and each agent's slow export ends afterwards."""
    import participant.jobs
    from tests.fedharness import Federation, wait_until

    real, slow_s = participant.jobs.export_onnx, 4.0

    def slow_export(arrays, task, path):  # noqa: ANN001, ANN202
        time.sleep(slow_s)
        return real(arrays, task, path)

    monkeypatch.setattr(participant.jobs, "export_onnx", slow_export)
    fed = Federation(tmp_path, broker, rounds=1, agents=2)
    files = [config.parent / "state" / "global_model.onnx" for config in fed.layout.agent_configs.values()]
    try:
        fed.start_with_server()
        wait_until(lambda: all(f.exists() for f in files), 90, "both agents' exports")
    finally:
        fed.close()
    (round_one,) = fed.metrics()
    assert round_one.finished_at < min(f.stat().st_mtime for f in files) - slow_s / 2  # closed, then exported


def test_the_export_checks_session_does_not_spin_between_runs(cnn):
    from models.onnx_runtime import cpu_session

    _, path, _ = cnn
    quiet, default = cpu_session(path, quiet=True), cpu_session(path)
    assert quiet.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # inference as deployed: its own choice
        default.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
    x = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    assert np.array_equal(quiet.run(["output0"], {"images": x})[0], default.run(["output0"], {"images": x})[0])
