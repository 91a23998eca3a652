"""Federated detection with Ultralytics YOLO: the agent trains from exactly the round's weights and returns an
fp32 delta weighted by its objects; class lists are checked; the server measures mAP with Ultralytics'
validator; a whole federation trains over a real broker and leaves an ONNX model the agent can run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch

import skyfed
from agent.config import load_agent_config
from agent.profile import DataProfile
from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from broker_server.rounds.evaluation import server_evaluator
from flcore.update import UpdateMeta, UpdateMetaError
from models.serialization import load_file
from models.synthetic_detection import NAMES, class_skew, write_dataset
from models.weights import delta, to_arrays
from models.yolo import shared_names
from models.yolo_dataset import DatasetError, class_counts, label_file, load_data_yaml, read_labels
from models.yolo_eval import DetectionEvaluator
from models.zoo import build_model
from participant.detector import StartMismatch, check_start
from protocol.config import ConfigError
from protocol.messages import ServerStatus
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import Topics
from sim.detection_data import describe_mixes, pool, write_detection_data
from sim.federation import SimSettings, create_federation
from sim.sweep import personalized_models
from tests.fedharness import Federation, override_toml, round_task, wait_until
from tests.fixtures import detect_task, start_arrays, trainer_for

SIZE = 64
CLASSES = list(NAMES)


@pytest.mark.parametrize("model", ["yolo11n", "yolov8n"])
def test_the_yolo_trainer_starts_from_exactly_the_round_weights(dataset, tmp_path, model):
    start, other = start_arrays(1, model), start_arrays(2, model)
    parameters = [name for name, _ in build_model(model, len(CLASSES)).named_parameters()]
    result = trainer_for(dataset, tmp_path).train(start, detect_task(lr=0.0, momentum=0.0, model=model))
    # with a zero learning rate the weights can only be the start weights if training began from them
    # (the EMA of identical weights may differ in the last bit); a re-initialised model is far away
    moved = max(float(np.abs(result.arrays[n] - start[n]).max()) for n in parameters)
    elsewhere = max(float(np.abs(other[n] - start[n]).max()) for n in parameters)
    assert moved < 1e-6 < 0.01 < elsewhere
    running = [n for n in start if n.endswith("running_mean")]
    assert any(not np.array_equal(result.arrays[n], start[n]) for n in running), "training did not run"


def test_a_model_changed_before_training_is_refused():
    start = start_arrays(1)
    model = build_model("yolo11n", len(CLASSES))
    with pytest.raises(StartMismatch, match="changed"):
        check_start(model, start)


def test_the_update_is_fp32_weighted_by_objects_with_local_map(dataset, tmp_path):
    start = start_arrays(1)
    result = trainer_for(dataset, tmp_path).train(start, detect_task())
    data = load_data_yaml(dataset)
    assert result.samples == len(data.train) == 8
    assert result.weight == int(class_counts(data.train, len(CLASSES)).sum()) > result.samples
    change = delta(result.arrays, start)
    assert {a.dtype for a in change.values()} == {np.dtype(np.float32)}
    assert all(np.isfinite(a).all() for a in change.values()) and any(np.abs(a).max() > 0 for a in change.values())
    assert {"map50", "map50_95"} <= set(result.local_eval) and all(0 <= v <= 1 for v in result.local_eval.values())
    meta = UpdateMeta(round=1, base_version=1, samples=result.samples, loss=result.loss, weight=result.weight,
                      local_eval=result.local_eval)  # fmt: skip
    assert UpdateMeta.from_metadata(meta.to_metadata()) == meta
    assert not list((tmp_path / "work").rglob("*.pt")), "Ultralytics' fp16 checkpoints are not left behind"


def test_class_list_and_task_mismatches_are_refused_with_a_reason(dataset, tmp_path):
    data = load_data_yaml(dataset)
    profile = DataProfile("detect", len(data.train), tuple(data.names))
    assert profile.refusal(detect_task()) == ""
    assert profile.refusal(detect_task(classes=["car", "truck", "person", "boat"])).startswith("class-mismatch:")
    assert profile.refusal(round_task()).startswith("wrong-task:")  # digits_cnn
    assert DataProfile("classify", 10).refusal(detect_task()).startswith("wrong-task: yolo11n is not a classifier")


@pytest.mark.parametrize(
    "local_eval", ['{"map50": NaN}', '{"map50": true}', json.dumps({f"k{i}": 0.1 for i in range(17)}), "[1]"]
)
def test_an_update_header_with_bad_local_metrics_is_refused(local_eval):
    metadata = UpdateMeta(round=1, base_version=1, samples=8, loss=1.0).to_metadata()
    with pytest.raises(UpdateMetaError, match="bad-metadata"):
        UpdateMeta.from_metadata({**metadata, "local_eval": local_eval})
    with pytest.raises(UpdateMetaError, match="bad-weight"):
        UpdateMeta.from_metadata({**metadata, "weight": "-5"})


def test_yolo_labels_are_checked_with_the_file_named(tmp_path):
    bad = tmp_path / "labels" / "x.txt"
    bad.parent.mkdir()
    for text, reason in (("0 0.5 0.5 0.1\n", "columns"), ("1.5 0.5 0.5 0.1 0.1\n", "integers"),
                         ("0 0.5 0.5 1.2 0.1\n", "normalised"), ("7 0.5 0.5 0.1 0.1\n", "names 4")):  # fmt: skip
        bad.write_text(text)
        with pytest.raises(DatasetError, match=reason) as caught:
            read_labels(bad, num_classes=4)
        assert str(bad) in str(caught.value)
    assert label_file(Path("/d/images/train/a.jpg")) == Path("/d/labels/train/a.txt")


def test_the_synthetic_set_is_reproducible_and_skewed_by_class(tmp_path):
    skew = class_skew(agent=1, agents=3, dominance=0.7)
    first = write_dataset(tmp_path / "a", train=12, val=2, seed=5, size=SIZE, class_probs=skew)
    second = write_dataset(tmp_path / "b", train=12, val=2, seed=5, size=SIZE, class_probs=skew)
    a, b = load_data_yaml(first), load_data_yaml(second)
    assert [p.read_bytes() for p in a.train] == [p.read_bytes() for p in b.train]
    counts = class_counts(a.train, len(CLASSES))
    assert counts.argmax() == 1 and counts[1] > counts.sum() / 2


def test_density_skew_gives_agents_different_object_counts_and_weights(tmp_path):
    names = ["agent-01", "agent-02", "agent-03"]
    mixes, density = write_detection_data(tmp_path, names, "iid", seed=0, images=12, image_size=SIZE,
                                          density_skew=0.5)  # fmt: skip
    assert density.tolist() == [3.0, 6.0, 9.0] and np.allclose(mixes, 0.25)
    objects = [class_counts(load_data_yaml(tmp_path / n / "data" / "data.yaml").train, 4).sum() for n in names]
    assert objects[0] < objects[1] < objects[2], objects  # 36, 72, 108 expected
    assert describe_mixes(mixes, density, names)[0].endswith("; 3.0 objects/image")


def test_a_pooled_dataset_under_a_relative_folder_is_found_from_anywhere(dataset, tmp_path, monkeypatch):
    """The centralized baseline pools the agents' sets; ``--out runs/x`` is relative, the agent's cwd is not."""
    monkeypatch.chdir(tmp_path)
    yaml_path = pool([dataset, dataset], Path("runs") / "pooled")
    monkeypatch.chdir("/")
    pooled = load_data_yaml(tmp_path / yaml_path)
    assert len(pooled.train) == 2 * len(load_data_yaml(dataset).train) and all(p.is_absolute() for p in pooled.train)


def test_the_server_measures_map_with_ultralytics_validator(dataset, tmp_path):
    evaluator = DetectionEvaluator("yolo11n", dataset, image_size=SIZE, work_dir=tmp_path / "eval")
    start = start_arrays(1)
    before = {k: v.copy() for k, v in start.items()}
    evaluation = evaluator(start)
    maps = {"map50", "map50_95", "precision", "recall"}
    assert set(evaluation) == maps | {"box_loss", "cls_loss", "dfl_loss"}  # the losses: test_detection_eval_loss
    assert all(0 <= evaluation[k] <= 1 for k in maps)
    assert all(np.array_equal(before[k], start[k]) for k in start), "the validator fused the caller's arrays"


def test_detector_configs_that_cannot_work_fail_at_start(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=1, agents=1, task="detect", images_per_agent=4, image_size=SIZE)
    path = fed.layout.server_config
    load_server_config(path)  # the sim's own config is fine
    (path.parent / "test.npz").write_bytes(b"")  # a classifier's evaluation file
    for change, message in (({"server": {"classes": []}}, "server.classes must name the classes"),
                            ({"server": {"eval_data": "test.npz"}}, "must be a YOLO data.yaml"),
                            ({"strategy": {"name": "fedprox"}}, "fedprox needs a proximal term"),
                            ({"server": {"classes": ["car", "truck", "person", "boat"]}}, "eval_data names classes"),
                            ({"server": {"num_classes": 3}}, "num_classes = 3 but")):  # fmt: skip
        original = path.read_text()
        override_toml(path, **change)
        with pytest.raises(ConfigError, match=message):
            load_server_config(path)
        path.write_text(original)
    # the other defences take detector updates as they are (named float32 deltas); DP keeps its own rules
    original = path.read_text()
    override_toml(path, strategy={"name": "fedavg", "threshold": 1}, bounds={"clip": "fixed", "clip_norm": 5.0})
    load_server_config(path)
    override_toml(path, privacy={"clip": 5.0, "noise_multiplier": 1.0}, bounds={"clip": "adaptive"})
    with pytest.raises(ConfigError, match="privacy.weight_cap"):  # uncapped object weights outweigh the clip
        load_server_config(path)
    override_toml(path, privacy={"weight_cap": 20.0})  # SmartFed's object weighting, each capped at 20 objects
    load_server_config(path)
    override_toml(path, strategy={"weighting": "uniform"}, privacy={"weight_cap": 0.0})
    load_server_config(path)
    path.write_text(original)
    fed.close()


def test_a_detection_round_runs_under_central_dp_and_a_threshold(tmp_path, broker):
    """The other defences take detector updates as they come (named float32 deltas): a real YOLO round with
    central DP (clip, noise, uniform weighting) that closes as soon as the threshold of updates is in."""
    fed = Federation(tmp_path, broker, rounds=1, agents=2, task="detect", images_per_agent=8, image_size=SIZE,
                     batch_size=4, strategy={"name": "fedavg", "weighting": "uniform", "threshold": 2},
                     privacy={"clip": 0.5, "noise_multiplier": 0.1})  # fmt: skip
    fed.run(Aggregator(load_server_config(fed.layout.server_config)), timeout_s=240)
    (metrics,) = fed.metrics()
    assert metrics.outcome == "committed" and len(metrics.accepted) == 2, metrics.aggregation
    assert metrics.privacy["epsilon"] > 0 and {"map50", "map50_95"} <= set(metrics.eval)


def test_an_agent_toml_asking_local_dp_sgd_of_a_detector_fails_at_start(tmp_path):
    settings = SimSettings(agents=1, rounds=1, task="detect", images_per_agent=2, image_size=SIZE)
    path = create_federation(tmp_path, settings, ("127.0.0.1", 1)).agent_configs["agent-01"]
    load_agent_config(path)
    override_toml(path, privacy={"noise_multiplier": 1.0})
    with pytest.raises(ConfigError, match='works with training.trainer = "classifier" only'):
        load_agent_config(path)


def test_a_detection_federation_reports_map_and_leaves_an_onnx_model_the_agent_runs(tmp_path, broker, capsys):
    short_deadline = lambda layout: override_toml(layout.server_config, rounds={"deadline_s": 30.0})  # noqa: E731
    fed = Federation(tmp_path, broker, rounds=2, agents=2, task="detect", images_per_agent=8, image_size=SIZE,
                     batch_size=4, partition="class-skew:0.7", edit=short_deadline)  # fmt: skip
    _, server = fed.start_with_server()
    server.join(240)
    assert not server.is_alive(), "the federation did not finish"
    metrics = fed.metrics()
    assert [m.round for m in metrics] == [1, 2] and all(len(m.accepted) == 2 for m in metrics)
    # the agents keep the final model as ONNX too, although no round task names its version (after the last
    # task's deadline: 30 s)
    final = metrics[-1].model_version
    wait_until(lambda: all(a.onboard.version == final and a.onboard.job is None for a in fed.agents), 120, "final onnx")
    fed.close()
    for m in metrics:
        assert {"map50", "map50_95", "box_loss", "cls_loss", "dfl_loss"} <= set(m.eval)
        assert set(m.aggregation["local_eval"]) == {"agent-01", "agent-02"}
        assert m.aggregation["onnx"]["ok"] and m.aggregation["onnx"]["max_abs_diff"] <= 1e-4
    assert (fed.server_state / "global_model.onnx").exists()

    status = retained_server_status(broker)  # the status topic carries a round's evaluation too
    assert {"map50", "map50_95"} <= set(status.eval) and status.eval in [m.eval for m in metrics]

    agent_config = fed.layout.agent_configs["agent-01"]
    x = np.random.default_rng(0).random((1, 3, SIZE, SIZE), dtype=np.float32)
    server_out, agent_out = (onnxruntime.InferenceSession(str(state / "global_model.onnx")).run(None, {"images": x})[0]
                             for state in (fed.server_state, agent_config.parent / "state"))  # fmt: skip
    np.testing.assert_allclose(agent_out, server_out, atol=1e-5)
    image = load_data_yaml(agent_config.parent / "data" / "data.yaml").val[0]
    capsys.readouterr()
    assert skyfed.main(["agent", "infer", "--config", str(agent_config), "--image", str(image)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["image"] == str(image) and isinstance(line["detections"], list)


def retained_server_status(broker) -> ServerStatus:
    client = MqttClient("probe", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
    client.subscribe(Topics("it").server_status)
    assert client.start(timeout_s=10)
    received = client.poll(10)
    client.stop()
    assert received is not None, "no retained server status"
    return ServerStatus.from_json(received[1])


def test_partial_aggregation_keeps_the_private_part_on_the_agent(dataset, tmp_path):
    trainer, start = trainer_for(dataset, tmp_path), start_arrays(1)
    model = build_model("yolo11n", len(CLASSES))
    head = set(start) - set(shared_names(list(start), model.yaml, "backbone"))
    assert head and all(int(n.split(".")[1]) >= len(model.yaml["backbone"]) for n in head)
    first = trainer.train(start, detect_task(share="backbone"))
    assert all(np.array_equal(first.arrays[n], start[n]) for n in head), "the head's change must stay local"
    assert any(not np.array_equal(first.arrays[n], start[n]) for n in set(start) - head)
    kept, _ = load_file(tmp_path / "work" / "private-backbone.safetensors")
    assert set(kept) == head and any(not np.array_equal(kept[n], start[n]) for n in head)
    # the next round starts from the new global backbone and this agent's own head (check_start would refuse
    # anything else), and its head keeps learning from where it was
    second = trainer.train(start, detect_task(share="backbone", round=2))
    assert all(np.array_equal(second.arrays[n], start[n]) for n in head)
    again, _ = load_file(tmp_path / "work" / "private-backbone.safetensors")
    assert any(not np.array_equal(again[n], kept[n]) for n in head)


def test_a_partial_federation_reports_the_agents_own_map(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=1, agents=2, task="detect", images_per_agent=8, image_size=SIZE,
                     batch_size=4, share="head")  # fmt: skip
    fed.run(Aggregator(load_server_config(fed.layout.server_config)), timeout_s=240)
    (metrics,) = fed.metrics()
    local = metrics.aggregation["local_eval"]
    assert set(local) == {"agent-01", "agent-02"} and metrics.aggregation["eval_source"].startswith("agents'")
    low, high = sorted(e["map50"] for e in local.values())
    assert low <= metrics.eval["map50"] <= high, (metrics.eval, local)
    assert "onnx" not in metrics.aggregation  # the global model alone is no agent's model
    # each agent's own model: the averaged neck + head with its private backbone, scored on the server's set
    config = load_server_config(fed.layout.server_config)
    global_arrays, _ = load_file(config.state_dir / "global_model.safetensors")
    models = personalized_models(fed.layout.server_config.parent.parent, global_arrays, "head")
    head = set(shared_names(list(global_arrays), build_model("yolo11n", len(CLASSES)).yaml, "head"))
    assert len(models) == 2 and all(set(m) == set(global_arrays) for m in models)
    assert all(np.array_equal(m[n], global_arrays[n]) for m in models for n in head)
    assert any(not np.array_equal(models[0][n], models[1][n]) for n in set(global_arrays) - head)
    scores = [server_evaluator(config)(m)["map50"] for m in models]
    assert all(0 <= s <= 1 for s in scores)


def test_partial_aggregation_is_refused_where_it_cannot_work(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=1, agents=1)  # digits
    override_toml(fed.layout.server_config, server={"share": "backbone"})
    with pytest.raises(ConfigError, match="for detector models"):
        load_server_config(fed.layout.server_config)
    fed.close()
    fed = Federation(tmp_path / "d", broker, rounds=1, agents=1, task="detect", images_per_agent=4, image_size=SIZE)
    override_toml(fed.layout.server_config, server={"share": "head"}, strategy={"name": "fedswap"})
    with pytest.raises(ConfigError, match="swapping strategies move whole models"):
        load_server_config(fed.layout.server_config)
    override_toml(fed.layout.server_config, server={"share": "neck"}, strategy={"name": "fedavg"})
    with pytest.raises(ConfigError, match="server.share must be one of full, backbone, head"):
        load_server_config(fed.layout.server_config)
    fed.close()


def test_a_local_ultralytics_checkpoint_is_the_start_model_only_when_it_fits(tmp_path, broker):
    torch.manual_seed(7)
    pretrained = build_model("yolo11n", len(CLASSES))
    torch.save({"model": pretrained.half()}, tmp_path / "pretrained.pt")  # Ultralytics stores fp16
    torch.save({"model": build_model("yolo11n", 3)}, tmp_path / "three-classes.pt")
    fed = Federation(tmp_path / "fed", broker, rounds=1, agents=1, task="detect", images_per_agent=4, image_size=SIZE)
    override_toml(fed.layout.server_config, server={"init_weights": str(tmp_path / "pretrained.pt")})
    server = Aggregator(load_server_config(fed.layout.server_config))
    expected = to_arrays(pretrained.float())
    assert all(np.array_equal(server.engine.global_arrays[n], expected[n]) for n in expected)
    fed.close()
    fed = Federation(tmp_path / "fed3", broker, rounds=1, agents=1, task="detect", images_per_agent=4, image_size=SIZE)
    override_toml(fed.layout.server_config, server={"init_weights": str(tmp_path / "three-classes.pt")})
    with pytest.raises(ValueError, match="does not fit this architecture/class count"):
        Aggregator(load_server_config(fed.layout.server_config))
    fed.close()


def test_sim_task_detect_picks_detection_defaults_and_refuses_classifier_partitions():
    from sim.cli import _settings

    args = skyfed.build_parser().parse_args(["sim", "--task", "detect", "--agents", "2"])
    settings = _settings(args)
    assert (settings.model, settings.partition, settings.lr, settings.batch_size) == ("yolo11n", "class-skew:0.7",
                                                                                      0.01, 16)  # fmt: skip
    assert settings.strategy == {"name": "fedavg"}  # object-weighted, as docs/results/detection.md measures
    digits = _settings(skyfed.build_parser().parse_args(["sim"]))
    assert digits.strategy == {}  # the server's default
    assert (digits.model, digits.partition, digits.lr, digits.batch_size) == ("digits_cnn", "dirichlet:0.5", 0.05, 32)
    demo = _settings(skyfed.build_parser().parse_args(["demo"]))
    assert demo.partition == "shards" and _settings(skyfed.build_parser().parse_args(["demo", "--task", "detect"]))
    for argv, message in ((["--partition", "dirichlet:0.5"], "not a detection partition"),
                          (["--model", "digits_cnn"], "not a detect model"),
                          (["--init-weights", "/nowhere.pt"], "no such file"),
                          (["--density-skew", "1"], "--density-skew must be in")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            _settings(skyfed.build_parser().parse_args(["sim", "--task", "detect", *argv]))
