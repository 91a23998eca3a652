"""The lines a finished ``skyfed sim`` prints: what each shape and kind of model is judged by."""

import json

from sim.summary import summary_lines
from tests.fedharness import round_metrics

PERSONAL = {"c_spe": 0.672, "c_gen": 0.41}


def test_a_personalized_run_ends_on_its_agents_c_spe_beside_the_global_score(tmp_path):
    rounds = [round_metrics(round=r, models="group", eval={"accuracy": 0.258}, personal=PERSONAL) for r in (1, 2)]
    lines = summary_lines(tmp_path, rounds, {"accuracy": 0.258}, seconds=3.0)
    assert lines[0].startswith("done in 3.0 s; final accuracy 0.258")
    assert "personal models (group): C-SPE 0.6720  C-GEN 0.4100  global accuracy 0.2580 (round 2" in lines[1]


def test_a_global_run_ends_on_its_model_alone(tmp_path):
    lines = summary_lines(tmp_path, [round_metrics(eval={"accuracy": 0.9}, personal=PERSONAL)], {"accuracy": 0.9},
                          seconds=1.0)  # fmt: skip
    assert len(lines) == 1


def test_a_peer_run_names_who_holds_the_elected_model(tmp_path):
    elections = {"p1": {"sha256": "ab" * 32}, "p2": {"sha256": "ab" * 32}, "p3": {"sha256": "cd" * 32}}
    (tmp_path / "election.json").write_text(json.dumps(elections))
    lines = summary_lines(tmp_path, [], {"accuracy": 0.8}, seconds=1.0)
    assert lines[1] == f"elected model {'ab' * 6}: held by 2 of 3 peers (p1, p2)"
    # as the sim saves it: attackers' decisions do not count; an entry that is no decision is left out
    elections |= {"p4": {"sha256": "cd" * 32}, "p5": {"sha256": "cd" * 32}, "p6": ["not", "a", "decision"]}
    (tmp_path / "election.json").write_text(json.dumps(elections))
    lines = summary_lines(tmp_path, [], {"accuracy": 0.8}, seconds=1.0, attackers=["p4", "p5"])
    assert lines[1] == f"elected model {'ab' * 6}: held by 2 of 6 peers (p1, p2)"


def test_a_region_run_gives_each_region_its_last_round(tmp_path):
    for region, accuracy in (("region-1", 0.91), ("region-2", 0.5)):
        folder = tmp_path / "regions" / region
        folder.mkdir(parents=True)
        rows = [round_metrics(round=r, eval={"accuracy": accuracy}).to_json().decode() for r in (1, 2, 3)]
        (folder / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "regions" / "region-3").mkdir()
    (tmp_path / "regions" / "region-3" / "metrics.jsonl").write_text("{garbage\n")
    lines = summary_lines(tmp_path, [], {"accuracy": 0.9}, seconds=1.0)
    assert lines[1] == "region-1: 3 rounds, last round 3 committed  accuracy 0.9100"
    assert lines[2].startswith("region-2: 3 rounds") and lines[3].startswith("region-3: unreadable metrics")
