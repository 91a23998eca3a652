"""``skyfed report PATH``: curves, each agent's rounds, and the privacy budget, from a run's metrics.jsonl (or one
metrics file); for every shape of run (a server's, a peer run, a region run's root and regions) and kind of model
(global, per agent, a detector), led by what the run optimizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sim.plot_agents import ACCEPTED, MISSED, NOT_SELECTED, REFUSED, agent_grid
from sim.plot_privacy import has_privacy
from sim.report_rows import read_rows
from tests.fixtures import election_rows, peer_rows, round_row, write_run

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
    assert not has_privacy(read_rows(tmp_path / "metrics.jsonl"))
    report = _skyfed("report", str(tmp_path))
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "agents.png").exists() and not (tmp_path / "privacy.png").exists()
    missing = _skyfed("report", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no " in missing.stderr and "metrics.jsonl" in missing.stderr


def test_report_on_a_peer_run_draws_one_curve_per_peer_and_marks_the_elected_model(tmp_path):
    """A peer run's rows are per peer and carry no ``accepted``: the report draws each peer's own curve (not one
    zig-zag 'global' line), stars the elected model and says who adopted it."""
    from sim.plot_peers import ElectedModel, draw_peer_curves

    rows = peer_rows()
    election = election_rows(["peer-1", "peer-2"], "peer-2") | {"peer-3": {"peer": "peer-3", "adopted_from": "peer-3",
                                                                      "sha256": "cd" * 32, "refused": ""}}  # fmt: skip
    folder = write_run(tmp_path / "peer", rows, election=election)
    report = _skyfed("report", str(folder))
    assert report.returncode == 0, report.stderr[-2000:]
    for name in ("curves.png", "agents.png"):
        assert (folder / name).read_bytes()[:8] == PNG
    fig = draw_peer_curves(rows, ElectedModel.read(folder / "election.json", []))
    score, loss, trained = fig.axes
    curves = {line.get_label(): list(line.get_ydata()) for line in score.lines}
    assert curves["peer-1 (adopted it)"] == [0.6, 0.7, 0.8]  # each peer its own rounds, in order
    assert curves["peer-3 (kept another)"] == [0.62, 0.72, 0.82]
    [star] = [line for line in score.lines if line.get_label() == "elected model"]
    assert list(star.get_xdata()) == [3] and list(star.get_ydata()) == [0.81]  # peer-2's last round
    assert score.get_title() == "Each peer's accuracy" and loss.get_title() == "Each peer's loss"
    assert trained.get_title().startswith("Each peer's trained C-SPE")  # the senders' reports
    assert {line.get_label(): list(line.get_ydata()) for line in trained.lines}["peer-1 (adopted it)"] == [0.9] * 3
    assert fig._suptitle.get_text().startswith("★ elected: peer-2's model (abababababab), adopted by 2 of 3 peers")


def test_a_peer_runs_agents_plot_says_whom_each_peer_aggregated_and_rejected():
    from sim.plot_peers import AGGREGATED, KEPT, peer_grid, sender_matrix

    rows = peer_rows()
    rows[0]["outcome"] = "rejected"  # peer-1 refused its own aggregate in round 1: it kept its model
    peers, rounds, outcome, counts = peer_grid(rows)
    assert peers == ["peer-1", "peer-2", "peer-3"] and rounds == [1, 2, 3]
    assert outcome[0].tolist() == [KEPT, AGGREGATED, AGGREGATED] and counts[:, 1].tolist() == [2, 2, 2]
    _, senders, taken, refused = sender_matrix(rows)
    assert senders == peers
    assert taken[0].tolist() == [3, 3, 2] and refused[:, 2].tolist() == [1, 1, 1] and refused.sum() == 3


def test_a_personalized_runs_curves_lead_with_c_spe_and_c_gen_the_global_score_beside():
    from sim.plots import draw_curves

    personal = {"c_spe": 0.9, "c_gen": 0.6, "agents": {"agent-1": {"c_spe": 0.9, "c_gen": 0.6}}}
    rows = [round_row(r, eval={"accuracy": 0.5, "loss": 1.2}, personal=personal, models="agent") for r in (1, 2)]
    score, loss = draw_curves(rows).axes
    assert score.get_title() == "Each agent's own model: C-SPE"
    labels = [line.get_label() for line in score.lines]
    assert labels == ["C-SPE (start model, own test split) (leads)", "C-GEN (start model, server set)",
                      "global accuracy"]  # fmt: skip
    assert [line.get_label() for line in loss.lines] == ["global loss"]
    # a row written before ``models`` existed is a global model's, whatever personal scores it carries
    old = [{k: v for k, v in r.items() if k != "models"} for r in rows]
    score, _ = draw_curves(old).axes
    assert score.get_title() == "Global model: accuracy" and score.lines[0].get_label() == "accuracy (leads)"


def test_a_detection_runs_plots_draw_what_its_evaluation_holds_and_name_the_agents_metric():
    """A detector evaluated without a loss (a row from before the server kept one): the second panel draws
    mAP@.5:.95, precision and recall instead of nothing; with its losses, those; each agent's C-SPE is its mAP@.5
    and says so."""
    from sim.plot_agents import draw_agents
    from sim.plots import draw_curves

    evaluation = {"map50": 0.4, "map50_95": 0.2, "precision": 0.5, "recall": 0.3}
    personal = {"c_spe": 0.35, "agents": {"agent-1": {"c_spe": 0.3}, "agent-2": {"c_spe": 0.4}}}
    rows = [round_row(r, eval=evaluation, personal=personal) for r in (1, 2)]
    score, other = draw_curves(rows).axes
    assert score.get_title() == "Global model: mAP@.5" and score.lines[0].get_label() == "mAP@.5 (leads)"
    assert [line.get_label() for line in other.lines] == ["mAP@.5:.95", "precision", "recall"]
    assert other.get_title() == "Global model mAP@.5:.95, precision, recall"
    _, own = draw_agents(rows).axes
    assert own.get_title() == "Each agent's start model: C-SPE (mAP@.5)" and len(own.lines) == 2
    assert own.get_ylabel() == "mAP@.5 on its own val split"
    # an evaluation with the detector's own val losses draws them in the second panel, the scores in the first
    losses = {"box_loss": 1.5, "cls_loss": 2.5, "dfl_loss": 1.25}
    score, other = draw_curves([round_row(r, eval={**evaluation, **losses}) for r in (1, 2)]).axes
    assert [line.get_label() for line in other.lines] == ["box loss", "cls loss", "dfl loss"]
    assert other.get_title() == "Global model loss" and "mAP@.5:.95" in [line.get_label() for line in score.lines]


def test_report_on_a_region_run_draws_the_roots_regions_and_each_regions_own_agents(tmp_path):
    """The root's participants are regions (``sim.region_run`` names their agents in ``regions``); each region's
    own metrics beside it get their own plots."""
    from sim.plot_agents import draw_agents
    from sim.report import write_report

    members = {"region-1": ["agent-1", "agent-2"], "region-2": ["agent-3"]}
    root = [round_row(r, accepted=["region-1", "region-2"], eval={"accuracy": 0.6}, regions=members) for r in (1, 2)]
    folder = write_run(tmp_path / "run", root)
    regional = {region: [round_row(r, accepted=agents, eval={"accuracy": 0.5 + 0.1 * r}) for r in (1, 2)]
                for region, agents in members.items()}  # fmt: skip
    for region, rows in regional.items():
        write_run(folder / "regions" / region, rows)
    written = write_report(folder, echo=lambda _line: None)
    assert {p.relative_to(folder).as_posix() for p in written} == {
        "curves.png", "agents.png", "regions/region-1/curves.png", "regions/region-1/agents.png",
        "regions/region-2/curves.png", "regions/region-2/agents.png"}  # fmt: skip
    grid, own = draw_agents(root, regional).axes
    assert [t.get_text() for t in grid.get_yticklabels()] == ["region-1 (2 agents)", "region-2 (1 agents)"]
    assert grid.get_ylabel() == "region" and own.get_title() == "Each region's aggregate: accuracy"
    assert [list(line.get_ydata()) for line in own.lines] == [[0.6, 0.7], [0.6, 0.7]]


def test_report_survives_markup_huge_names_and_values_and_broken_lines(tmp_path):
    """Names are drawn as plain text (mathtext '$…$' would fail to parse), cut short; numbers beyond any score
    are gaps; a line that is not a round is skipped with its reason."""
    hostile = ["$x^$", "_nolegend_", "a" * 10_000, "\\frac{$", "<b>x</b>\n\t"]
    rows = [round_row(r, accepted=hostile, rejected=[{"agent": "$$", "reason": "$\\bad{" * 1000}, {"nope": 1}, "x"],
                   eval={"accuracy": 1e308, "loss": float("inf") if r == 1 else -1e300},
                   personal={"c_spe": 0.5, "agents": {name: {"c_spe": 1e308} for name in hostile}})
            for r in (1, 2)]  # fmt: skip
    peers = [{**row, "peer": name} for row in peer_rows(2, 2) for name in (row["peer"], hostile[0])]
    election = {"$x^$": {"sha256": "e" * 64, "adopted_from": "a" * 10_000}, "bad": "not a record"}
    for folder, content, extra in ((tmp_path / "server", rows, {}), (tmp_path / "peer", peers, {"election": election})):
        write_run(folder, content, **extra)
        with open(folder / "metrics.jsonl", "a") as handle:
            handle.write('{"round": "1"}\n[1, 2]\n{"round": 10000000000000}\n{"round": 3, "eval": [1]}\n')
            handle.write('{"round": 4, "acc')  # cut short by a crash
        report = _skyfed("report", str(folder))
        assert report.returncode == 0, report.stderr[-3000:]
        assert "skipped 2 line(s)" in report.stdout and "not a JSON object" in report.stdout
        assert (folder / "curves.png").read_bytes()[:8] == PNG and (folder / "agents.png").read_bytes()[:8] == PNG


def test_a_metrics_file_with_no_round_draws_nothing_and_says_so(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": -1}\n')
    report = _skyfed("report", str(tmp_path))
    assert report.returncode == 1 and "holds no round: nothing drawn" in report.stdout
    assert not (tmp_path / "curves.png").exists()



def test_an_earlier_runs_metrics_set_aside_draw_beside_it_under_its_own_name(tmp_path):
    """A server that starts a new run in its state folder renames the earlier run's file metrics-<UTC>.jsonl
    (``MetricsLog.set_aside``): ``skyfed report FILE`` draws that run, its plots named after the file, and leaves the
    current run's plots alone."""
    folder = write_run(tmp_path / "state", [round_row(r, accepted=["a"], eval={"accuracy": 0.9}) for r in (1, 2)])
    earlier = folder / "metrics-20261205T172507Z.jsonl"
    earlier.write_text("".join(json.dumps(round_row(r, accepted=["a", "b"], eval={"accuracy": 0.5})) + "\n"
                               for r in (1, 2, 3)))  # fmt: skip
    (folder / "curves.png").write_bytes(b"the current run's")
    report = _skyfed("report", str(earlier))
    assert report.returncode == 0, report.stderr
    drawn = sorted(p.name for p in folder.glob("metrics-20261205T172507Z.*.png"))
    assert drawn == ["metrics-20261205T172507Z.agents.png", "metrics-20261205T172507Z.curves.png"], report.stdout
    assert all((folder / name).read_bytes().startswith(PNG) for name in drawn)
    assert (folder / "curves.png").read_bytes() == b"the current run's"
    assert _skyfed("report", str(folder / "metrics.jsonl")).returncode == 0  # the current run's file: its own names
    assert (folder / "curves.png").read_bytes().startswith(PNG)
