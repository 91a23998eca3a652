"""Peer mode with YOLO detectors over a real broker: each peer trains with the agents' detector trainer from
the same seeded start model, scores models with mAP@.5 on its data.yaml's val split, and the elected model is
scored on the centralized sim's evaluation set. Tiny images (64 px), 4 per peer, one epoch, as
tests/test_detection.py keeps detection fast."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agent.config import load_agent_config
from models.serialization import load_file, save_file
from models.zoo import initial_model
from protocol.config import ConfigError
from sim.federation import SimSettings
from sim.peer_federation import create_peer_federation
from sim.run import run_sim
from tests.fedharness import override_toml

SIZE = 64


def detect_settings(**overrides: object) -> SimSettings:
    return SimSettings(**{"mode": "peer", "task": "detect", "agents": 2, "rounds": 2, "epochs": 1,
                          "images_per_agent": 4, "image_size": SIZE, "batch_size": 4, "deadline_s": 120,
                          **overrides})  # fmt: skip


def test_a_detect_peer_federation_scores_map_each_round_and_elects_a_model(tmp_path, broker):
    result = run_sim(detect_settings(), tmp_path / "out", broker_address=broker.address, echo=lambda line: None)
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["round"], line["peer"]) for line in lines] == [(1, "agent-01"), (1, "agent-02"), (2, "agent-01"),
                                                                 (2, "agent-02")]  # fmt: skip
    assert all(line["aggregated_from"] == ["agent-01", "agent-02"] and not line["rejected"] for line in lines)
    assert all({"map50", "map50_95"} <= set(line["eval"]) for line in lines)  # mAP on each peer's own val split
    elections = json.loads((tmp_path / "out" / "election.json").read_text())
    assert len({e["sha256"] for e in elections.values()}) == 1  # both peers hold the elected model
    elected = load_file(tmp_path / "out" / "global_model.safetensors")[0]
    assert set(elected) == set(initial_model("yolo11n", 3, 0))
    assert 0 <= result.final_eval["map50"] <= 1 and "map50_95" in result.final_eval  # on server/eval/data.yaml


def test_a_detect_peer_whose_data_does_not_fit_the_plan_fails_at_start(tmp_path, broker):
    layout = create_peer_federation(tmp_path / "fed", detect_settings(), (broker.host, broker.port))
    path = layout.agent_configs["agent-01"]
    load_agent_config(path)  # as written: valid
    for change, message in (({"federation": {"classes": ["car", "bus", "person"]}}, "federation.classes is"),
                            ({"federation": {"image_size": 100}}, "federation.image_size must be a multiple of 32"),
                            ({"training": {"trainer": "classifier"}}, 'needs training.trainer = "detector"'),
                            ({"federation": {"init_weights": "gone.pt"}}, "federation.init_weights")):
        original = path.read_text()
        override_toml(path, **change)
        with pytest.raises(ConfigError, match=message):
            load_agent_config(path)
        path.write_text(original)


def test_detect_peers_start_from_the_sims_init_weights_when_given(tmp_path, broker):
    warm = initial_model("yolo11n", 3, 7)
    save_file(tmp_path / "warm.safetensors", warm)
    settings = detect_settings(init_weights=str(tmp_path / "warm.safetensors"))
    layout = create_peer_federation(tmp_path / "fed", settings, (broker.host, broker.port))
    config = load_agent_config(layout.agent_configs["agent-02"])
    start = initial_model("yolo11n", 3, config.federation.seed, config.init_weights_path)
    assert all(np.array_equal(start[name], warm[name]) for name in warm)
    seeded = initial_model("yolo11n", 3, config.federation.seed)
    assert not all(np.array_equal(seeded[name], warm[name]) for name in warm)
