"""The headline every surface leads with (protocol.scores): personal models are judged by C-SPE first,
the global model by its own score, detectors by mAP; a sender cannot forge it."""

import json

from protocol.messages import RoundMetrics
from protocol.scores import round_headline, row_headline
from sim.run import format_round
from tests.fedharness import round_metrics

PERSONAL = {"c_spe": 0.672, "c_gen": 0.41, "agents": {"a1": {"c_spe": 0.7}}}


def test_personal_models_lead_with_c_spe_and_show_the_global_score_beside():
    keys = [s["key"] for s in round_headline("group", {"accuracy": 0.258, "loss": 2.0}, PERSONAL)]
    assert keys == ["c_spe", "c_gen", "accuracy", "loss"]
    labels = [s["label"] for s in round_headline("agent", {"accuracy": 0.258}, PERSONAL)]
    assert labels == ["C-SPE", "C-GEN", "global accuracy"]


def test_a_metrics_row_is_judged_again_from_its_numbers_and_an_old_row_as_a_global_models():
    row = {"eval": {"accuracy": 0.5}, "personal": PERSONAL, "models": "agent",
           "headline": [{"key": "accuracy", "label": "forged", "value": 1.0}]}  # fmt: skip
    assert [s["key"] for s in row_headline(row)] == ["c_spe", "c_gen", "accuracy"]
    old = {k: v for k, v in row.items() if k not in ("models", "headline")}  # written before ``models`` existed
    assert [s["key"] for s in row_headline(old)] == ["accuracy", "c_spe", "c_gen"]
    assert row_headline({**row, "models": "<b>", "eval": [1], "personal": "x"}) == []


def test_a_global_model_leads_with_its_own_score_and_detectors_with_map():
    assert [s["key"] for s in round_headline("global", {"accuracy": 0.9, "loss": 0.3}, PERSONAL)] == [
        "accuracy", "loss", "c_spe", "c_gen"]  # fmt: skip
    detect = round_headline("global", {"map50": 0.4, "map50_95": 0.2, "loss": None}, {})
    assert [s["key"] for s in detect] == ["map50", "map50_95"]  # no "loss None"


def test_the_headline_is_derived_never_taken_from_the_sender():
    m = round_metrics(eval={"accuracy": 0.25, "loss": float("nan")}, personal=PERSONAL, models="group")
    forged = {**json.loads(m.to_json()), "headline": [{"key": "c_spe", "label": "<b>C-SPE</b>", "value": 1.0}]}
    received = RoundMetrics.from_dict(forged)
    assert received.headline == m.headline and received.headline[0] == {"key": "c_spe", "label": "C-SPE",
                                                                          "value": 0.672}  # fmt: skip


def test_the_console_line_of_a_personalized_round_leads_with_c_spe():
    line = format_round(round_metrics(eval={"accuracy": 0.258, "loss": 2.1}, personal=PERSONAL, models="group"), 1.0)
    assert line.index("C-SPE 0.6720") < line.index("C-GEN 0.4100") < line.index("global accuracy 0.2580")
    detect = format_round(round_metrics(eval={"map50": 0.41, "map50_95": 0.2}), 1.0)
    assert "mAP@.5 0.4100" in detect and "None" not in detect
    losses = {"box_loss": 1.5, "cls_loss": 2.5, "dfl_loss": 1.25}
    detect = format_round(round_metrics(eval={"map50": 0.41, "map50_95": 0.2, **losses}, personal=PERSONAL), 1.0)
    assert "mAP@.5 0.4100  mAP@.5:.95 0.2000  box loss 1.5000  participants" in detect
    classify = format_round(round_metrics(eval={"accuracy": 0.9, "loss": 0.3}, personal=PERSONAL), 1.0)
    assert "accuracy 0.9000  loss 0.3000  participants" in classify  # a global model's own scores, not C-SPE
