"""The user-facing commands as a user runs them: ``skyfed sim --broker``, ``skyfed monitor``, ``skyfed keys``."""

import argparse
import json
import re
import time
from pathlib import Path

import pytest

from agent.config import load_agent_config
from broker_server.config import load_server_config
from flcore.rounds import RoundRules
from models.serialization import load_file
from models.weights import load_arrays
from models.zoo import build_model
from protocol.mqtt import MqttClient
from sim import run as sim_run
from sim.classify_layout import POOL_FILE, Sharing
from sim.federation import SimSettings, create_federation
from sim.scale import (
    SERVER_STATUS_DELIVERIES_PER_S,
    STATUS_RATE_PER_S,
    hosted_tick_s,
    round_deadline_s,
    server_status_interval_s,
    status_interval_s,
)
from skyfed import main
from tests.liveharness import metrics_rows, skyfed

ROOT = Path(__file__).resolve().parent.parent


def test_sim_against_an_existing_broker_writes_metrics_curves_and_model(tmp_path, broker):
    out = tmp_path / "run"
    result = skyfed(
        "sim",
        "--agents",
        "3",
        "--rounds",
        "3",
        "--partition",
        "dirichlet:0.5",
        "--seed",
        "1",
        "--out",
        str(out),
        "--broker",
        broker.address,
        "--federation",
        "simtest",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    round_lines = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    assert len(round_lines) == 3 and "accuracy" in round_lines[0] and "MB up" in round_lines[0]
    for agent in ("agent-01", "agent-02", "agent-03"):  # not a terminal: a plain progress line per agent
        assert f"  round   1  {agent} training" in result.stdout, result.stdout
        assert re.search(rf"  round   1  {agent} trained in \d+\.\d s", result.stdout), result.stdout
    rows = metrics_rows(out)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for key in (
        "strategy",
        "participants",
        "accepted",
        "rejected",
        "duration_s",
        "aggregate_s",
        "bytes_up",
        "bytes_down",
        "eval",
    ):
        assert key in rows[0]
    assert rows[-1]["eval"]["accuracy"] > 0.8
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    arrays, _ = load_file(out / "global_model.safetensors")
    load_arrays(build_model("digits_cnn"), arrays)  # PyTorch state_dict names, loadable as is
    for agent in ("agent-01", "agent-02", "agent-03"):  # each agent's partition in the documented format
        assert (out / "federation" / agent / "data.npz").exists()

    snapshot = skyfed("monitor", "--broker", broker.address, "--federation", "simtest", "--once", "--timeout", "2")
    assert snapshot.returncode == 0, snapshot.stderr
    assert "finished" in snapshot.stdout and "agent-02" in snapshot.stdout


def test_sim_task_detect_runs_yolo_agents_as_daemons_and_leaves_a_checked_onnx_model(tmp_path, broker):
    out = tmp_path / "detect"
    result = skyfed("sim", "--task", "detect", "--agents", "2", "--rounds", "1", "--epochs", "1", "--images-per-agent",
                    "4", "--image-size", "64", "--batch-size", "4", "--density-skew", "0.5", "--out", str(out),
                    "--broker", broker.address, "--federation", "detecttest", timeout=400)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "strategy fedavg" in result.stdout and "3.0 objects/image" in result.stdout
    assert "mAP@.5" in next(line for line in result.stdout.splitlines() if line.startswith("round "))
    (row,) = metrics_rows(out)
    assert {"map50", "map50_95"} <= set(row["eval"]) and row["aggregation"]["onnx"]["ok"]
    assert set(row["aggregation"]["local_eval"]) == {"agent-01", "agent-02"}
    infer = skyfed("agent", "infer", "--model", str(out / "global_model.onnx"), "--image",
                   str(out / "federation" / "agent-01" / "data" / "images" / "val"))  # fmt: skip
    assert infer.returncode == 0, infer.stderr
    lines = [json.loads(line) for line in infer.stdout.splitlines()]
    assert len(lines) == 4 and all(isinstance(line["detections"], list) for line in lines)  # max(4, 4 // 4) val images


def test_sim_with_a_robust_strategy_and_attackers_says_who_attacked(tmp_path, broker):
    """Also: two agents per OS process (``--agents-per-process``), the attacker hosted with an honest one."""
    out = tmp_path / "attacked"
    result = skyfed(
        "sim", "--agents", "4", "--rounds", "2", "--strategy", "trimmed-mean", "--strategy-option", "beta=0.25",
        "--attackers", "1", "--attack", "samples:100000", "--partition", "iid", "--out", str(out), "--broker",
        broker.address, "--federation", "attacked", "--agents-per-process", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    hosts = sorted(p.name for p in (out / "federation" / "logs").glob("agent-*.log"))
    assert hosts == ["agent-01..agent-02.log", "agent-03..agent-04.log"]
    assert "strategy trimmed-mean" in result.stdout and "attackers (samples:100000, parameters): " in result.stdout
    rows = metrics_rows(out)
    assert [r["strategy"] for r in rows] == ["trimmed-mean"] * 2
    assert rows[0]["attack"] == "samples:100000" and len(rows[0]["attackers"]) == 1
    assert rows[0]["aggregation"]["trimmed_per_side"] == 1 and rows[0]["aggregation"]["capped"] == rows[0]["attackers"]
    assert rows[-1]["eval"]["accuracy"] > 0.5


def test_a_threshold_round_closes_on_the_fast_agents_without_waiting_for_a_slow_one(tmp_path, broker):
    """SmartFed's threshold with devices of unequal speed: one agent trains 300x slower (``--slow-agents``),
    K = 3 of 4, so every round closes on the three fast agents' updates, and the slow one never counts."""
    out = tmp_path / "slow"
    result = skyfed(
        "sim", "--agents", "4", "--rounds", "3", "--strategy", "fedavg", "--strategy-option", "threshold=3",
        "--slow-agents", "1", "--slowdown", "300", "--partition", "iid", "--out", str(out), "--broker",
        broker.address, "--federation", "slow",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = metrics_rows(out)
    slow = rows[0]["slow_agents"]
    assert len(slow) == 1 and f"slow agents (300x): {slow[0]}" in result.stdout
    assert [len(r["accepted"]) for r in rows] == [3, 3, 3]
    assert all(slow[0] not in r["accepted"] for r in rows)
    assert (out / "federation" / "logs" / f"{slow[0]}.log").exists()  # hosted alone by sim.agent_host


def test_fedprox_partial_work_asks_a_slow_agent_for_less_and_the_agent_does_less(tmp_path, broker):
    """FedProx's partial work end to end: the server times the agents, the next task asks the slow one
    (30x slower at computing) for a share of the local work, and that agent trains that share. A fast agent's
    first round pays PyTorch's start-up (7-8 s on a loaded machine) and training 0.2-0.6 s: 30x stays behind it,
    and a 120 s deadline holds the slow agent's round (100x at 60 s missed it on a loaded machine)."""
    out = tmp_path / "partial"
    result = skyfed(
        "sim", "--agents", "3", "--rounds", "2", "--strategy", "fedprox", "--strategy-option", "partial_work=true",
        "--slow-agents", "1", "--slowdown", "30", "--deadline", "120", "--partition", "iid", "--out", str(out),
        "--broker", broker.address, "--federation", "partial",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = metrics_rows(out)
    slow = rows[0]["slow_agents"][0]
    assert "work" not in rows[0]["aggregation"]  # round 1: nobody timed yet
    work = rows[1]["aggregation"]["work"][slow]
    assert work < 1 and all(len(r["accepted"]) == 3 for r in rows), rows[1]["aggregation"]
    log = (out / "federation" / "logs" / f"{slow}.log").read_text()
    assert f"trained round=2 start=global action=average work={work:g} " in log


def test_sim_with_central_dp_reports_epsilon_and_stops_when_the_budget_is_spent(tmp_path, broker):
    """``--dp-*``: each round's metrics carry the worst agent's (ε, δ); with a target of 3.5 at z = 2 two
    rounds fit (3.19), a third would not (4.01), so the run of 10 rounds ends after 2 with
    ``budget_exhausted`` in the retained server status, which ``skyfed monitor`` shows."""
    out = tmp_path / "dp"
    result = skyfed(
        "sim", "--agents", "3", "--rounds", "10", "--strategy", "fedavg", "--strategy-option", "weighting=uniform",
        "--dp-clip", "0.5", "--dp-noise", "2", "--dp-target-epsilon", "3.5", "--partition", "iid", "--out", str(out),
        "--broker", broker.address, "--federation", "private",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = metrics_rows(out)
    from broker_server.privacy.accountant import epsilon_of
    from broker_server.privacy.noise import NORM_SLACK

    assert [r["privacy"]["epsilon"] for r in rows] == [round(epsilon_of(((2.0, n),), 1e-5), 4) for n in (1, 2)]
    noise_std = 2 * 0.5 * (1 + NORM_SLACK) / 3
    assert rows[0]["privacy"]["delta"] == 1e-5 and rows[0]["aggregation"]["noise_std"] == pytest.approx(noise_std)
    assert f"epsilon {rows[1]['privacy']['epsilon']}" in result.stdout
    assert f"stopped after 2 of 10 rounds: the privacy budget is spent (epsilon {rows[1]['privacy']['epsilon']}" in (
        result.stdout
    )
    snapshot = skyfed(
        "monitor", "--broker", broker.address, "--federation", "private", "--once", "--timeout", "2", columns=200
    )
    assert "budget_exhausted" in snapshot.stdout and f"ε {rows[1]['privacy']['epsilon']} of 3.5" in snapshot.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--partition", "dirichlet:x"], "dirichlet:ALPHA"),
        (["--strategy", "fedmagic"], "--strategy: invalid choice: 'fedmagic' (choose from 'auto', 'fedavg'"),
        (["--strategy", "krum", "--strategy-option", "f=-1"], "strategy.f must be >= 0"),
        (["--strategy-option", "weighting"], "must look like KEY=VALUE"),
        (["--attackers", "1"], "--attackers needs --attack KIND"),
        (["--attack", "sign-flip"], "--attack sign-flip needs --attackers N: how many of the 4 agents attack"),
        (["--attackers", "1", "--attack", "scale"], "--attack 'scale' must be sign-flip, scale:F"),
        (["--attackers", "4", "--attack", "sign-flip"], "--attackers must be between 0 and --agents - 1"),
        (["--agents-per-process", "0"], "--agents-per-process must be >= 1"),
        (["--agents", "3", "--slow-agents", "4"], "--slow-agents must be between 0 and the number of honest agents"),
        (["--slow-agents", "1", "--slowdown", "0.5"], "--slowdown must be >= 1"),
        (["--dp-clip", "1", "--dp-noise", "1", "--strategy", "centered-clip"],
         "privacy cannot run strategy.name = 'centered-clip'"),
        (["--dp-clip", "1", "--dp-noise", "1", "--strategy-option", "weighting=samples"], "needs privacy.weight_cap"),
        (["--momentum", "1"], "--momentum must be in [0, 1) (0: plain SGD), got 1.0"),
        (["--dp-noise", "1"], "privacy.clip must be > 0 to turn differential privacy on"),
        (["--ldp-target-epsilon", "3"], "privacy.target_epsilon needs privacy.noise_multiplier > 0"),
        (["--ldp-noise", "1", "--ldp-clip", "0"], "privacy.max_grad_norm must be > 0"),
        (["--in-process", "--broker", "127.0.0.1:1883"], "--in-process uses no broker: drop --broker"),
        (["--in-process", "--slow-agents", "1"], "--in-process runs its agents at one speed"),
        (["--broker", "127.0.0.1:"], "skyfed sim: "),  # a malformed address: one line, not a traceback
        (["--mode", "peer", "--task", "detect", "--share", "head"], "--share is not available with --mode peer"),
        (["--mode", "peer", "--strategy", "fedswap"], "federation.strategy.name 'fedswap' does not work between peers"),
        # options that changed nothing on main: FedAMN ran plain FedAvg, unify gave the pool nothing, without a word
        (["--strategy", "fedamn", "--rounds", "5"], "--rounds 5: fedamn runs 5 rounds, all before strategy.after = 10"),
        (["--share-ratio", "0.05", "--share-mode", "unify"], "0 agents' data to the server's pool, so there would be "
                                                             "no pool: use --share-ratio 0.25 or more"),
    ],
)
def test_sim_refuses_bad_arguments_with_a_message(args, message, capsys):
    """The command's ``main`` in this process (no interpreter start per case): exit code 2, the reason, no traceback."""
    try:
        code = main(["sim", *args])
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    stderr = capsys.readouterr().err
    assert code == 2 and message in stderr, stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"mode": "peer", "keep_momentum": True}, "--keep-momentum is not available with --mode peer: the peers'"),
        ({"mode": "peer", "local_privacy": {"noise_multiplier": 1.0}}, "--ldp-* is not available with --mode peer"),
        ({"mode": "peer", "strategy": {"elect_best": False}}, "--strategy-option elect_best is not available with --m"),
        ({"in_process": True, "worker": "per-round"}, "--worker is not available with --in-process: its trainers run"),
        ({"in_process": True, "agents_per_process": 2}, "--agents-per-process is not available with --in-process"),
        ({"in_process": True, "deadline_s": 30.0}, "--deadline is not available with --in-process"),
        ({"image_size": 320}, "--image-size is not available with --task classify: it is the detector's image size"),
        ({"init_weights": "warm.pt"}, "--init-weights is not available with --task classify"),
        ({"share": "head"}, "--share is not available with --task classify"),
        ({"share_mode": "unify"}, "--share-mode unify needs --share-ratio R: without it no data is shared"),
        ({"regions": 2, "share_ratio": 0.5}, "--share-ratio is not available with --regions: no region trains"),
    ],
)
def test_an_option_the_run_would_never_read_is_refused_naming_it_and_why(settings, message):
    """On main each of these ran as if the option had not been given."""
    with pytest.raises(ValueError) as err:
        SimSettings(**settings)
    assert message in str(err.value), str(err.value)
    assert str(err.value).endswith("drop it") or "needs --share-ratio" in message


def test_a_share_ratio_that_gives_the_pool_no_sample_is_refused_with_one_that_does(tmp_path):
    """share-disjoint: floor(ratio x n) = 0 for every agent's n samples ran with no pool and no word on main."""
    result = skyfed("sim", "--in-process", "--share-ratio", "0.0001", "--out", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    found = re.search(r"gives the server's pool no sample \(floor\(ratio x samples\) = 0 for every agent\), so "
                      r"there would be no pool: use --share-ratio ([0-9.]+) or more", result.stderr)  # fmt: skip
    assert found, result.stderr
    from sim.classify_layout import write_classify_data

    names = ["agent-01", "agent-02", "agent-03", "agent-04"]
    write_classify_data(tmp_path / "fed", names, "dirichlet:0.5", 0, sharing=Sharing(4, float(found[1])))
    assert (tmp_path / "fed" / "server" / POOL_FILE).exists()  # the ratio it names gives the pool a sample


def test_what_the_server_would_only_log_about_the_strategy_is_said_on_the_console(tmp_path):
    """Krum's f lowered to nothing for 4 agents was in server.log only; the run here fails after the warning (its
    --out cannot be made), so no federation runs."""
    (tmp_path / "plainfile").write_text("")
    result = skyfed("sim", "--strategy", "krum", "--out", str(tmp_path / "plainfile" / "run"), timeout=60)
    assert result.returncode == 1, result.stderr
    assert "warning: strategy krum f=2 needs 7 updates a round; with 4 agents enrolled (4 updates a round) f is " \
           "lowered to 0: no protection" in result.stdout, result.stdout  # fmt: skip
    from sim.start_check import start_warnings

    assert "round 5 averages early" in start_warnings(SimSettings(rounds=5, strategy={"name": "fedswap", "h1": 2}))[0]
    assert start_warnings(SimSettings(agents=8, strategy={"name": "krum"})) == []  # 8 updates: f = 2 holds


def test_momentum_and_a_thesis_model_reach_the_servers_training_settings(tmp_path):
    """``--momentum 0`` (plain SGD, seed 004's optimizer) is what the server sends agents; it was 0.9, unsettable."""
    from common import toml

    out = tmp_path / "run"
    result = skyfed("sim", "--in-process", "--agents", "2", "--rounds", "1", "--momentum", "0", "--lr", "0.001",
                    "--model", "thesis_cnn_digits", "--out", str(out), timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    server = toml.loads((out / "federation" / "server" / "server.toml").read_text())
    assert server["training"]["momentum"] == 0 and server["training"]["lr"] == 0.001
    assert server["server"]["model"] == "thesis_cnn_digits" and len(metrics_rows(out)) == 1


def test_an_out_folder_that_cannot_be_made_is_one_line_not_a_traceback(tmp_path):
    (tmp_path / "plainfile").write_text("")
    out = tmp_path / "plainfile" / "run"
    result = skyfed("sim", "--in-process", "--agents", "2", "--rounds", "1", "--out", str(out), timeout=120)
    assert result.returncode == 1 and result.stderr.startswith("skyfed sim: "), result.stderr
    assert "Traceback" not in result.stderr


def test_keys_new_refuses_to_overwrite_and_enroll_copies_the_public_key(tmp_path):
    assert skyfed("keys", "new", "drone-07", "--dir", str(tmp_path), timeout=60).returncode == 0
    assert (tmp_path / "drone-07.key").stat().st_mode & 0o777 == 0o600
    again = skyfed("keys", "new", "drone-07", "--dir", str(tmp_path), timeout=60)
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    enrolled = skyfed(
        "keys", "enroll", str(tmp_path / "drone-07.pub"), "--enrolled", str(tmp_path / "enrolled"), timeout=60
    )
    assert enrolled.returncode == 0 and (tmp_path / "enrolled" / "drone-07.pub").exists()


def test_sweep_table_reports_mean_and_sd_per_configuration_and_condition():
    from sim.sweep import table

    rows = [{"condition": "clean", "configuration": "median", "final_accuracy": acc} for acc in (0.98, 0.96, 0.97)] + [
        {"condition": "sign-flip", "configuration": "median", "final_accuracy": None}
    ]
    median_line = next(line for line in table(rows).splitlines() if line.startswith("| median |"))
    assert median_line.startswith("| median | 97.0 ± 1.0 | – |")


def test_an_experiment_file_with_a_bad_key_is_refused_before_any_run(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('title = "t"\n[methods]\nswap = {strategy = {name = "fedswap", h1 = 0}}\n')
    result = skyfed("sim", "--config", str(config), "--out", str(tmp_path / "out"), timeout=60)
    assert result.returncode == 2 and "strategy.h1 must be >= 1" in result.stderr, result.stderr
    config.write_text('title = "t"\n[sim]\nagnets = 3\n')
    result = skyfed("sim", "--config", str(config), "--out", str(tmp_path / "out"), timeout=60)
    assert result.returncode == 2 and "agnets is not a known key; did you mean 'agents'" in result.stderr


def test_experiment_summary_counts_only_published_models_towards_the_target():
    from sim.experiment import summarise

    def line(round_number, action, accuracy):
        return {"round": round_number, "action": action, "outcome": "committed", "eval": {"accuracy": accuracy},
                "finished_at": 10.0 * round_number, "duration_s": 10.0, "bytes_up": 100, "bytes_down": 50}  # fmt: skip

    metrics = [line(1, "local", 0.95), line(2, "swap", 0.96), line(3, "average", 0.8), line(4, "average", 0.91)]
    summary = summarise(metrics, target=0.9)
    assert summary["rounds_to_target"] == 4 and summary["seconds_to_target"] == 40.0
    # DemLearn ("group") and FedAMP publish the mean every round under their own action: the version moves on
    grouped = [{**line(r, "group", acc), "model_version": r + 1} for r, acc in ((1, 0.5), (2, 0.92), (3, 0.95))]
    assert summarise(grouped, target=0.9)["rounds_to_target"] == 2
    assert summary["bytes_up_per_round"] == 100 and summary["bytes_down_per_round"] == 50


def test_a_finished_experiment_is_summarised_again_from_its_metrics_with_the_current_target(tmp_path):
    """Changing ``target`` and re-running an experiment whose runs are all done runs nothing and rewrites
    results.md from the stored metrics."""
    from sim.experiment import Experiment, run_experiment

    (tmp_path / "metrics").mkdir()
    rounds = [{"round": r, "action": "average", "outcome": "committed", "eval": {"accuracy": acc},
               "finished_at": 10.0 * r, "duration_s": 10.0, "bytes_up": 100, "bytes_down": 50}
              for r, acc in ((1, 0.85), (2, 0.92), (3, 0.96))]  # fmt: skip
    (tmp_path / "metrics" / "c-m-0.jsonl").write_text("\n".join(json.dumps(r) for r in rounds) + "\n")
    row = {"condition": "c", "method": "m", "seed": 0, "final_accuracy": 0.96, "rounds": 3, "seconds": 30.0,
           "rounds_to_target": 2, "seconds_to_target": 20.0}  # fmt: skip
    (tmp_path / "runs.jsonl").write_text(json.dumps(row) + "\n")
    experiment = Experiment(title="t", seeds=[0], target=0.95, conditions={"c": {}}, methods={"m": {}})
    rows = run_experiment(experiment, tmp_path, echo=lambda _line: None)
    assert rows[0]["rounds_to_target"] == 3 and rows[0]["seconds_to_target"] == 30.0
    assert "| c | m | 96.0 ± 0.0 | 3.0 ± 0.0 | 30.0 ± 0.0 |" in (tmp_path / "results.md").read_text()


def test_experiment_reports_final_c_spe_c_gen_and_rounds_until_c_gen_reached_its_target(tmp_path):
    """A row's ``personal`` describes the models the previous round produced, so C-GEN reaching
    the target in row 3 counts as 2 rounds; the last row gives the final C-SPE and C-GEN. Each line leads with
    its method's own score, named: the global model's for FedAvg (rows written before ``models`` existed
    count as a global model's), C-SPE for a method whose agents keep their own models."""
    from sim.experiment import Experiment, run_experiment

    (tmp_path / "metrics").mkdir()
    rounds = [{"round": r, "action": "average", "outcome": "committed", "eval": {"accuracy": acc},
               "finished_at": 10.0 * r, "duration_s": 10.0, "aggregate_s": 0.002, "bytes_up": 100, "bytes_down": 50,
               "personal": {"c_spe": spe, "c_gen": gen, "agents": {},
                            "trained": {"c_spe": spe + 0.02, "c_gen": gen + 0.15}}}
              for r, acc, spe, gen in ((1, 0.5, 0.1, 0.1), (2, 0.6, 0.7, 0.5), (3, 0.7, 0.9, 0.65),
                                       (4, 0.72, 0.95, 0.6))]  # fmt: skip
    (tmp_path / "metrics" / "c-m-0.jsonl").write_text("\n".join(json.dumps(r) for r in rounds) + "\n")
    own = [{**r, "models": "agent", "action": "fedamp"} for r in rounds]
    (tmp_path / "metrics" / "c-amp-0.jsonl").write_text("\n".join(json.dumps(r) for r in own) + "\n")
    row = {"condition": "c", "method": "m", "seed": 0, "final_accuracy": 0.72, "rounds": 4, "seconds": 40.0}
    (tmp_path / "runs.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({**row, "method": "amp"}) + "\n")
    experiment = Experiment(title="t", seeds=[0], target=0.9, personal_target=0.6, conditions={"c": {}},
                            methods={"m": {}, "amp": {}})  # fmt: skip
    summary, personal = run_experiment(experiment, tmp_path, echo=lambda _line: None)
    assert (summary["final_c_spe"], summary["final_c_gen"], summary["rounds_to_c_gen"]) == (0.95, 0.6, 2)
    # the trained models of row r had r rounds of training: C-GEN 0.65 in row 2 is 2 rounds
    assert summary["final_trained_c_spe"] == pytest.approx(0.97) and summary["rounds_to_trained_c_gen"] == 2
    assert summary["aggregate_ms_per_round"] == 2.0
    assert (summary["lead"], personal["lead"]) == ("accuracy", "c_spe")
    results = (tmp_path / "results.md").read_text()
    assert ("| condition | method | lead: the method's own score % | final C-SPE % | final C-GEN % | rounds to C-GEN "
            "60% | final trained C-SPE % | final trained C-GEN % | rounds to trained C-GEN 60% | final global accuracy "
            "% | rounds to 90% |") in results, results  # fmt: skip
    trained = "97.0 ± 0.0 | 75.0 ± 0.0 | 2.0 ± 0.0 | 72.0 ± 0.0 | never |"
    assert f"| c | m | accuracy 72.0 ± 0.0 | 95.0 ± 0.0 | 60.0 ± 0.0 | 2.0 ± 0.0 | {trained}" in results
    assert f"| c | amp | C-SPE 95.0 ± 0.0 | 95.0 ± 0.0 | 60.0 ± 0.0 | 2.0 ± 0.0 | {trained}" in results
    assert (tmp_path / "curves-c.png").stat().st_size > 0


class StarvedWatcher(MqttClient):
    """The sim's metrics subscriber on a machine too loaded to read before the server exits (300 agents here
    missed the last round's line): its messages all arrive after the server finished."""

    def poll(self, timeout_s):
        time.sleep(timeout_s)


def test_rounds_whose_messages_arrive_after_the_server_exited_are_reported_from_its_metrics_log(
    tmp_path, broker, monkeypatch
):
    monkeypatch.setattr(sim_run, "MqttClient", StarvedWatcher)
    lines = []
    settings = SimSettings(agents=2, rounds=2, agents_per_process=2, epochs=1, partition="iid", federation="late")
    result = sim_run.run_sim(settings, tmp_path / "run", broker_address=broker.address, echo=lines.append)
    assert [m.round for m in result.metrics] == [1, 2]
    assert [line.split()[1] for line in lines if line.startswith("round ")] == ["1", "2"]
    assert result.final_eval == result.metrics[-1].eval  # the last committed round's model, evaluated


def test_a_large_sim_federation_beats_slower_so_the_server_checks_at_most_25_statuses_a_second(tmp_path):
    """1,000 agents at one status every 2 s made the server verify 500 signed statuses a second on 2 cores."""
    layout = create_federation(tmp_path, SimSettings(agents=2, rounds=1), ("127.0.0.1", 1883))
    assert load_agent_config(layout.agent_configs["agent-02"]).agent.status_interval_s == 2.0  # small: responsive
    assert [status_interval_s(n) for n in (50, 300, 1000)] == [2.0, 12.0, 20.0]
    assert all(n / status_interval_s(n) <= STATUS_RATE_PER_S * 1.000001 for n in range(1, 501))
    assert status_interval_s(10_000) <= RoundRules().status_timeout_s / 3  # a status that late: not eligible


def test_a_large_sim_federation_server_publishes_its_status_less_often_so_agents_read_at_most_50_a_second(tmp_path):
    """Every agent reads the server's status: at 1,000 agents, every 2 s, 20 of them a round per agent."""
    layout = create_federation(tmp_path, SimSettings(agents=2, rounds=1), ("127.0.0.1", 1883))
    assert load_server_config(layout.server_config).server.status_interval_s == 2.0  # small: responsive
    assert [server_status_interval_s(n) for n in (50, 100, 300, 1000, 10_000)] == [2.0, 2.0, 6.0, 20.0, 20.0]
    assert all(n / server_status_interval_s(n) <= SERVER_STATUS_DELIVERIES_PER_S * 1.000001 for n in range(1, 1001))


def test_a_large_sim_federation_gets_a_deadline_its_agents_can_meet_on_a_shared_machine():
    """At 300 agents a 60 s deadline closed rounds on 193 updates and refused the rest as late."""
    assert SimSettings(agents=3).deadline_s == SimSettings(agents=120).deadline_s == 60.0
    assert SimSettings(agents=300).deadline_s == round_deadline_s(300) == 150.0
    assert SimSettings(agents=300, deadline_s=30).deadline_s == 30.0  # --deadline wins


def test_a_large_sim_federations_agents_keep_no_onboard_onnx_model(tmp_path):
    """1,000 agents' ONNX exports (0.7 s of CPU each) would take 12 CPU-minutes a round on 2 cores."""
    small = create_federation(tmp_path / "small", SimSettings(agents=2, rounds=1), ("127.0.0.1", 1883))
    large = create_federation(tmp_path / "large", SimSettings(agents=60, rounds=1, partition="iid"),
                              ("127.0.0.1", 1883))  # fmt: skip
    assert load_agent_config(small.agent_configs["agent-01"]).training.onnx
    assert not load_agent_config(large.agent_configs["agent-60"]).training.onnx


def test_a_process_hosting_many_agents_turns_their_idle_loops_at_most_100_times_a_second(tmp_path):
    """1,000 agents, 100 to a process, each ticking every 0.1 s, kept 2 cores busy while none trained."""
    from sim.agent_host import build_agents

    layout = create_federation(tmp_path, SimSettings(agents=12, rounds=1), ("127.0.0.1", 1883))
    args = argparse.Namespace(config=[str(c) for c in layout.agent_configs.values()], attacker=[], attack="",
                              scope="parameters", slow=[], slowdown=1.0, jobs_at_once=2)  # fmt: skip
    agents = build_agents(args)
    assert [a.edge.tick_interval_s for a in agents] == [0.12] * 12
    assert hosted_tick_s(1) == hosted_tick_s(10) == 0.1 and hosted_tick_s(100) == 1.0
