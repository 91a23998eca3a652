"""``skyfed report DIR``: curves, each agent's rounds, and the privacy budget, from a run's metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sim.plots import ACCEPTED, MISSED, NOT_SELECTED, REFUSED, agent_grid, has_privacy

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def _skyfed(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skyfed", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)  # fmt: skip


def test_the_agents_grid_says_what_each_round_did_with_each_agent():
    rows = [
        {"round": 1, "accepted": ["a", "b"], "rejected": [{"agent": "c", "reason": "malformed: x"}], "missed": []},
        {"round": 2, "accepted": ["a"], "rejected": [], "missed": ["b"]},
        # a re-sent update refused as duplicate after its first copy was accepted: the agent delivered
        {"round": 3, "accepted": ["b"], "rejected": [{"agent": "b", "reason": "duplicate"}], "missed": []},
    ]
    agents, grid = agent_grid(rows)
    assert agents == ["a", "b", "c"]
    assert grid.tolist() == [[ACCEPTED, ACCEPTED, NOT_SELECTED], [ACCEPTED, MISSED, ACCEPTED],
                             [REFUSED, NOT_SELECTED, NOT_SELECTED]]  # fmt: skip


def test_report_draws_curves_agents_and_the_privacy_budget_of_a_central_dp_run(tmp_path):
    out = tmp_path / "run"
    run = _skyfed("sim", "--in-process", "--agents", "3", "--rounds", "2", "--dp-clip", "1", "--dp-noise", "1",
                  "--out", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    report = _skyfed("report", str(out))
    assert report.returncode == 0, report.stderr
    for name in ("curves.png", "agents.png", "privacy.png"):
        assert f"wrote {out / name}" in report.stdout
        assert (out / name).read_bytes()[:8] == PNG


def test_report_draws_no_privacy_plot_for_a_run_without_a_budget_and_names_a_missing_file(tmp_path):
    rows = [{"round": 1, "accepted": ["a"], "rejected": [], "missed": [], "eval": {"accuracy": 0.5, "loss": 1.0},
             "privacy": {}, "aggregation": {}}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not has_privacy(tmp_path / "metrics.jsonl")
    report = _skyfed("report", str(tmp_path))
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "agents.png").exists() and not (tmp_path / "privacy.png").exists()
    missing = _skyfed("report", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no " in missing.stderr and "metrics.jsonl" in missing.stderr
