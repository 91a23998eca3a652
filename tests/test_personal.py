"""Personalization metrics: C-SPE, each agent's start model on its own test split (its report),
and C-GEN, the same model on the server's evaluation set, in every round's metrics for every strategy."""

from __future__ import annotations

import json
import math

import pytest

from flcore.personal import personal_metrics
from flcore.update import UpdateMeta, UpdateMetaError
from sim.federation import SimSettings
from sim.run import run_sim


def test_personal_metrics_by_hand():
    c_spe = {"a": {"accuracy": 0.9, "loss": 0.3}, "b": {"accuracy": 0.7}, "c": {}}
    start_of = {"a": "group-0", "b": "group-1", "c": "group-1"}
    c_gen_of = {"group-0": {"accuracy": 0.5}, "group-1": {"accuracy": 0.6}}
    assert personal_metrics(c_spe, start_of, c_gen_of) == {
        "c_spe": 0.8, "c_gen": pytest.approx(0.566667), "agents": {
            "a": {"c_spe": 0.9, "c_gen": 0.5}, "b": {"c_spe": 0.7, "c_gen": 0.6}, "c": {"c_gen": 0.6}},
    }  # fmt: skip
    assert personal_metrics({}, {"a": "global-v1"}, {}) == {}  # nothing measured: nothing said


def test_huge_claimed_start_evaluations_do_not_stop_the_round_from_closing(tmp_path):
    """Two rogue agents claim C-SPE 1e308 (finite, so the header takes it): the mean must not overflow, or
    every close of the round raises, and again after a restart (the updates are checkpointed)."""
    huge = {"accuracy": 1e308}
    means = personal_metrics({"a": huge, "b": huge}, {"a": "global-v1", "b": "global-v1"}, {})
    assert means["c_spe"] == pytest.approx(1e308) and means["agents"]["a"]["c_spe"] == 1e308


def test_the_start_evaluation_travels_in_the_update_header_and_is_checked_like_local_eval():
    meta = UpdateMeta(round=3, base_version=2, samples=10, loss=0.5, start_eval={"accuracy": 0.75, "loss": 0.6})
    assert UpdateMeta.from_metadata(meta.to_metadata()).start_eval == {"accuracy": 0.75, "loss": 0.6}
    bad = {**meta.to_metadata(), "start_eval": json.dumps({"accuracy": float("inf")})}
    with pytest.raises(UpdateMetaError, match="bad-metadata"):
        UpdateMeta.from_metadata(bad)
    huge = {**meta.to_metadata(), "start_eval": json.dumps({"a" * 40: 0.5})}
    with pytest.raises(UpdateMetaError, match="bad-metadata: start_eval values must be finite numbers under names"):
        UpdateMeta.from_metadata(huge)
    nan_loss = UpdateMeta(round=3, base_version=2, samples=10, loss=0.5, start_eval={"accuracy": 0.1, "loss": math.nan})
    assert UpdateMeta.from_metadata(nan_loss.to_metadata()).start_eval == {"accuracy": 0.1}  # the update still counts


@pytest.mark.parametrize("strategy", ["fedavg", "demlearn"])
def test_every_round_reports_c_spe_and_c_gen_of_the_models_agents_started_from(tmp_path, strategy):
    settings = SimSettings(agents=4, rounds=2, partition="shards", in_process=True, strategy={"name": strategy},
                           federation="p")  # fmt: skip
    result = run_sim(settings, tmp_path / "run", echo=lambda _line: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(result.metrics) == 2
    for row in rows:
        personal = row["personal"]
        assert set(personal["agents"]) == set(row["accepted"])
        assert all(0 <= a["c_spe"] <= 1 and 0 <= a["c_gen"] <= 1 for a in personal["agents"].values())
        assert 0 <= personal["c_spe"] <= 1
    first, second = rows
    assert len({a["c_gen"] for a in first["personal"]["agents"].values()}) == 1  # round 1: the initial model
    gens = {a["c_gen"] for a in second["personal"]["agents"].values()}
    if strategy == "fedavg":  # everyone started round 2 from the global model round 1 published
        assert gens == {first["eval"]["accuracy"]}
    else:  # each agent from its group's model: two groups, two scores (the seed's levels = 3 gives ≥ 2 here)
        assert len(gens) >= 2
        groups = first["aggregation"]["groups"]
        assert {g["level"] for g in groups} == {1, 2, 3} and all(0 <= g["g_gen"] <= 1 for g in groups)
        for group in (g for g in groups if g["level"] == 1):  # round 2 started from them: the same score
            for member in group["members"]:
                assert second["personal"]["agents"][member]["c_gen"] == group["g_gen"]


def test_the_monitor_shows_c_spe_and_c_gen_of_a_round(tmp_path):
    from rich.console import Console

    from broker_server.watch.monitor import FederationView
    from broker_server.watch.monitor_tables import render
    from protocol.messages import RoundMetrics
    from protocol.topics import Topics

    metrics = RoundMetrics(round=3, strategy="demlearn", participants=["a"], accepted=["a"], rejected=[],
                           duration_s=1.0, aggregate_s=0.01, bytes_up=1, bytes_down=1, eval={"accuracy": 0.5},
                           model_version=4, finished_at=0.0,
                           personal={"c_spe": 0.875, "c_gen": 0.625, "agents": {"a": {"c_spe": 0.875}},
                                     "trained": {"c_spe": 0.9375, "c_gen": 0.375}},
                           models="group")  # fmt: skip
    view = FederationView(Topics("p"))
    line = view.apply(Topics("p").server_metrics, metrics.to_json())
    assert "c_spe=0.8750 trained_c_spe=0.9375 c_gen=0.6250 trained_c_gen=0.3750" in line
    console = Console(record=True, width=240)
    console.print(render(view))
    text = console.export_text()
    assert "C-SPE" in text and "0.8750" in text
    assert "trained C-SPE" in text and "0.9375" in text and "trained C-GEN" in text and "0.3750" in text
