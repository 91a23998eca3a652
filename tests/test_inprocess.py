"""``skyfed sim --in-process``: the round engine and the agents' trainers in one process."""

from __future__ import annotations

import json

import pytest

from broker_server.privacy.accountant import epsilon_of
from broker_server.privacy.noise import NORM_SLACK
from broker_server.privacy.policy import PrivacyPolicy
from sim.federation import SimSettings
from sim.run import run_sim


def test_an_in_process_federation_learns_spends_its_budget_and_stops_cleanly(tmp_path):
    """12 agents under central DP with an adaptive clip and a target that affords two rounds of three:
    every agent trains and is charged each round, the clip adapts, and the run stops at the budget."""
    z = 2.0
    target = (epsilon_of(((z, 2),), 1e-5) + epsilon_of(((z, 3),), 1e-5)) / 2
    settings = SimSettings(agents=12, rounds=3, model="mlp_digits", partition="iid", epochs=2, lr=0.1,
                           strategy={"name": "fedavgm", "weighting": "uniform"}, in_process=True,
                           privacy={"clip": 1.0, "noise_multiplier": z, "target_epsilon": target,
                                    "adaptive_clip": True})  # fmt: skip
    lines: list[str] = []
    result = run_sim(settings, tmp_path / "run", echo=lines.append)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(r["in_process"] for r in rows)
    assert all(len(r["accepted"]) == 12 and r["outcome"] == "committed" for r in rows)
    assert rows[-1]["privacy"]["epsilon"] == pytest.approx(epsilon_of(((z, 2),), 1e-5), abs=1e-4)
    assert rows[1]["aggregation"]["clip_bound"] == pytest.approx(rows[0]["aggregation"]["next_clip"], rel=1e-5)
    policy = PrivacyPolicy(**settings.privacy)
    for row in rows:  # the noise of the round's own clip, with the count's share taken out of z
        expected = policy.update_noise_multiplier(12) * row["aggregation"]["clip_bound"] * (1 + NORM_SLACK) / 12
        assert row["aggregation"]["noise_std"] == pytest.approx(expected, rel=1e-5) and "accuracy" in row["eval"]
        # the agents' own test scores stay out of what DP publishes; how many start models were scored is public
        assert set(row["personal"]) == {"c_gen", "scored"} and row["personal"]["scored"] == 12
    assert (tmp_path / "run" / "global_model.safetensors").exists() and (tmp_path / "run" / "curves.png").exists()
    assert len(result.metrics) == 2 and any(line.startswith("round   2") for line in lines)


def test_in_process_refuses_what_it_does_not_simulate():
    with pytest.raises(ValueError, match="--in-process runs its agents at one speed"):
        SimSettings(agents=4, slow_agents=1, in_process=True)


def test_in_process_attackers_send_what_their_attack_says(tmp_path):
    """The agent ``attacker_names`` draws attacks as the daemons' would: its claim of 10⁶ samples is the
    one the server caps, and the metrics name it."""
    settings = SimSettings(agents=3, rounds=1, model="mlp_digits", partition="iid", epochs=1, in_process=True,
                           attackers=1, attack="samples:1000000", strategy={"name": "fedavg"})  # fmt: skip
    run_sim(settings, tmp_path / "run", echo=lambda _line: None)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["attackers"] == settings.attacker_names() and row["attack"] == "samples:1000000"
    assert row["aggregation"]["capped"] == settings.attacker_names(), row["aggregation"]


def test_in_process_silent_attackers_never_deliver(tmp_path):
    """``--attack silent`` in process: the attacker trains but its update never reaches the engine (before,
    it was sent honestly), so the round averages the others and the metrics say who was missing."""
    settings = SimSettings(agents=3, rounds=1, model="mlp_digits", partition="iid", epochs=1, in_process=True,
                           attackers=1, attack="silent", strategy={"name": "fedavg"})  # fmt: skip
    run_sim(settings, tmp_path / "run", echo=lambda _line: None)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    silent = settings.attacker_names()
    assert row["outcome"] == "committed" and row["attack"] == "silent"
    assert sorted(row["accepted"]) == sorted(set(row["participants"]) - set(silent)), row
