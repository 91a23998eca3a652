"""The light agent daemon: PyTorch only in its training child, which may crash or hang without taking
the daemon down; per-round and warm children; the deployed agent trains through a real child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agent.config import load_agent_config
from agent.daemon import EdgeAgent
from agent.runner import ChildRunner
from common import toml
from models.weights import to_arrays
from models.zoo import build_model
from participant.jobs import Cancelled, Declined, Exported, Failed, Trained
from protocol.config import ConfigError
from sim.federation import SimSettings, create_federation
from tests.fedharness import Federation, override_toml, round_task, wait_until


@pytest.fixture
def agent_config(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    return layout.agent_configs["agent-01"]


def finish(job, timeout_s: float = 120.0):
    return wait_until(job.poll, timeout_s, f"the {job.kind} job to finish")


def digits_task(**overrides):
    return round_task(selected=["agent-01"], pending=["agent-01"], **overrides)


def test_the_agent_daemon_and_what_it_imports_leave_pytorch_out():
    code = "import sys, agent.daemon, agent.cli, agent.telemetry; print(sorted(m for m in ('torch', 'ultralytics', 'opacus', 'onnxruntime') if m in sys.modules))"  # noqa: E501
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_a_per_round_child_trains_exports_and_is_gone_after_each_job(agent_config, tmp_path):
    override_toml(agent_config, training={"worker": "per-round"})
    runner = ChildRunner(load_agent_config(agent_config))
    base = to_arrays(build_model("digits_cnn"))
    outcome = finish(runner.train(base, digits_task(), export_to=tmp_path / "m.onnx"))
    assert isinstance(outcome, Trained) and outcome.result.samples > 0 and np.isfinite(outcome.result.loss)
    assert set(outcome.result.arrays) == set(base) and isinstance(outcome.export, Exported)
    assert (tmp_path / "m.onnx").stat().st_size > 0
    first = runner.child
    wait_until(lambda: not first.alive(), 30, "the per-round child to exit")
    assert isinstance(finish(runner.train(base, digits_task(round=2))), Trained) and runner.child is not first


def test_a_warm_child_serves_rounds_and_a_crashed_one_is_a_failed_job_then_replaced(agent_config):
    override_toml(agent_config, training={"worker": "warm"})
    runner = ChildRunner(load_agent_config(agent_config))
    base = to_arrays(build_model("digits_cnn"))
    assert isinstance(finish(runner.train(base, digits_task())), Trained)
    warm = runner.child
    assert isinstance(finish(runner.train(base, digits_task(round=2))), Trained) and runner.child is warm
    job = runner.train(base, digits_task(round=3))
    os.kill(warm.process.pid, signal.SIGKILL)  # the OOM killer, say
    outcome = finish(job)
    assert isinstance(outcome, Failed) and "killed by signal 9" in outcome.reason
    assert isinstance(finish(runner.train(base, digits_task(round=4))), Trained) and runner.child is not warm
    runner.close()
    assert not runner.child.alive()


def holds_pytorch(child) -> bool:
    """The child has loaded PyTorch's library (what its start-up costs)."""
    try:
        return "libtorch" in Path(f"/proc/{child.process.pid}/maps").read_text()
    except OSError:
        return False


def test_an_adaptive_child_starts_when_a_round_is_announced_and_goes_after_its_idle_time(agent_config):
    """The deployed default: the child starts (and loads PyTorch) as soon as a round selects the agent, before
    the model is there; once idle for training.warm_idle_s it exits, and is not started again for that round."""
    override_toml(agent_config, training={"worker": "adaptive", "warm_idle_s": 1.0})
    agent = EdgeAgent(load_agent_config(agent_config))
    try:
        agent.task = digits_task()
        agent._step()
        child = agent.runner.child
        assert agent.state == "waiting-model" and child is not None and child.alive()
        agent._step()
        assert agent.runner.child is child and child.alive()  # one child per announced round
        wait_until(lambda: holds_pytorch(child), 60, "the announced round's child to load PyTorch")
        time.sleep(1.0)
        agent._step()
        assert not child.alive() and agent.state == "waiting-model"
        agent._step()
        assert agent.runner.child is child  # released for this round: not started again
        agent.task = digits_task(attempt=2)
        agent._step()
        assert agent.runner.child is not child and agent.runner.child.alive()
    finally:
        agent.runner.close()


def test_an_adaptive_child_starts_as_the_agent_joins_unless_its_gate_is_closed(agent_config):
    """Started, gate open, no task yet: a round usually follows, so the child loads PyTorch while the server
    starts; it goes after its idle time like any other and is not started again until a round is announced.
    With the gate closed (quiet hours all day) nothing starts, and a gate that closes lets the child go at once."""
    override_toml(agent_config, training={"worker": "adaptive", "warm_idle_s": 1.0},
                  gate={"quiet_hours": ["00:00-12:00", "12:00-00:00"]})  # fmt: skip
    gated = EdgeAgent(load_agent_config(agent_config))
    try:
        gated._step()
        assert gated.runner.child is None and gated.state == "gated"
    finally:
        gated.runner.close()
    override_toml(agent_config, gate={"quiet_hours": []})
    agent = EdgeAgent(load_agent_config(agent_config))
    try:
        agent._step()
        child = agent.runner.child
        assert child is not None and child.alive() and agent.task is None
        wait_until(lambda: holds_pytorch(child), 60, "the joining agent's child to load PyTorch")
        time.sleep(1.0)
        agent._step()
        assert not child.alive()
        agent._step()
        assert agent.runner.child is child  # released while waiting: not started again before a round
        agent.task = digits_task()
        agent._step()
        prepared = agent.runner.child
        assert prepared is not child and prepared.alive()
        agent.edge.telemetry.policy = replace(agent.edge.telemetry.policy, quiet_hours=("00:00-12:00", "12:00-00:00"))
        agent._step()
        assert agent.state == "gated" and not prepared.alive()  # armed, say: its start-up must not take the cores
    finally:
        agent.runner.close()


def test_an_adaptive_child_serves_rounds_that_keep_coming_and_is_released_only_when_idle(agent_config):
    override_toml(agent_config, training={"worker": "adaptive", "warm_idle_s": 1.0})
    runner = ChildRunner(load_agent_config(agent_config))
    base = to_arrays(build_model("digits_cnn"))
    assert isinstance(finish(runner.train(base, digits_task())), Trained)
    kept = runner.child
    runner.release_idle()
    assert isinstance(finish(runner.train(base, digits_task(round=2))), Trained) and runner.child is kept
    time.sleep(1.0)
    runner.release_idle()
    assert not kept.alive()
    job = runner.train(base, digits_task(round=3))
    time.sleep(1.0)
    runner.release_idle()  # a job not yet collected is a job running
    assert runner.child is not kept and runner.child.alive() and isinstance(finish(job), Trained)
    runner.close()


def test_a_job_past_its_time_limit_is_killed_and_reported(agent_config):
    override_toml(agent_config, training={"time_limit_s": 0.5})
    runner = ChildRunner(load_agent_config(agent_config))
    job = runner.train(to_arrays(build_model("digits_cnn")), digits_task())
    outcome = finish(job)
    assert isinstance(outcome, Failed) and "training.time_limit_s=0.5" in outcome.reason
    assert not runner.child.alive()


def test_a_cancelled_job_kills_its_child_at_once(agent_config):
    runner = ChildRunner(load_agent_config(agent_config))
    job = runner.train(to_arrays(build_model("digits_cnn")), digits_task())
    started = time.monotonic()
    job.cancel("armed: the flight controller reports armed")
    assert time.monotonic() - started < 2 and not runner.child.alive()
    assert job.poll() == Cancelled("armed: the flight controller reports armed")


def test_a_spent_local_privacy_budget_is_declined_by_the_child(agent_config):
    override_toml(agent_config, privacy={"noise_multiplier": 1.0, "target_epsilon": 0.01})
    runner = ChildRunner(load_agent_config(agent_config))
    outcome = finish(runner.train(to_arrays(build_model("mlp_digits")), digits_task(model="mlp_digits")))
    assert isinstance(outcome, Declined) and outcome.reason.startswith("privacy-budget-spent")


def test_a_deployed_agent_trains_through_its_child_and_a_crash_does_not_stop_it(tmp_path, broker):
    """The agent as ``skyfed agent run`` builds it (its default worker, adaptive), in a real federation: its first
    child is killed mid-training, the daemon reports it and carries on: the server stops waiting for it (its
    signed status says the round failed) and backs it off for a round, and a later round trains it again."""
    short_deadline = lambda layout: override_toml(layout.server_config, rounds={"deadline_s": 45.0})  # noqa: E731
    fed = Federation(
        tmp_path, broker, rounds=3, agents=2, worker="deployed", edit=short_deadline, strategy={"name": "fedavg"}
    )
    deployed = fed.agents[0] = EdgeAgent(load_agent_config(fed.layout.agent_configs["agent-01"]))
    fed.threads[0] = threading.Thread(target=deployed.run, args=(fed.stop,), daemon=True)
    server, server_thread = fed.start_with_server()
    try:
        wait_until(lambda: deployed.client.training is not None and deployed.runner.child is not None, 60, "training")
        os.kill(deployed.runner.child.process.pid, signal.SIGKILL)
        wait_until(lambda: deployed.state == "failed", 30, "the failure to be reported")
        assert "killed by signal 9" in deployed.report.status().detail
        server_thread.join(240)
        assert not server_thread.is_alive(), "the federation did not finish"
    finally:
        fed.close()
    committed = [m for m in fed.metrics() if m.outcome == "committed"]
    assert [m.round for m in committed] == [1, 2, 3] and "agent-01" in committed[0].missed
    assert "agent-01" in committed[-1].accepted
    assert deployed.edge.errors >= 1 and deployed.client.progress.last_completed_round == 3


def test_ultralytics_keeps_its_settings_under_the_agent_state_dir_even_when_an_export_comes_first(tmp_path):
    """The child sets Ultralytics' offline settings before any job: an ONNX export of a YOLO model may be its
    first import of Ultralytics, which reads YOLO_CONFIG_DIR once and writes settings.json there."""
    settings = SimSettings(agents=1, rounds=1, federation="it", task="detect", images_per_agent=2, image_size=64)
    config_path = create_federation(tmp_path, settings, ("127.0.0.1", 1)).agent_configs["agent-01"]
    code = ("import sys; from pathlib import Path; from agent.training_child import Worker; Worker(Path(sys.argv[1])); "
            "from ultralytics.utils import SETTINGS, ONLINE; print(SETTINGS.file_path, ONLINE)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("YOLO_")}
    out = subprocess.run([sys.executable, "-c", code, str(config_path)], capture_output=True, text=True, env=env,
                         check=True).stdout.split()  # fmt: skip
    settings_file, online = Path(out[-2]), out[-1]
    assert settings_file.is_relative_to(load_agent_config(config_path).detector_dir / "ultralytics")
    assert settings_file.exists() and online == "False"


def test_sim_worker_deployed_runs_the_agents_as_skyfed_agent_run_does_by_default(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it", worker="deployed"),
                               ("127.0.0.1", 1))  # fmt: skip
    config = layout.agent_configs["agent-01"]
    assert "worker" not in toml.loads(config.read_text())["training"]
    assert load_agent_config(config).training.worker == "adaptive"
    with pytest.raises(ValueError, match="--worker must be one of adaptive, per-round, warm, deployed"):
        SimSettings(worker="lazy")


def test_a_warm_idle_time_that_is_not_positive_fails_at_start_naming_the_key(agent_config):
    override_toml(agent_config, training={"warm_idle_s": 0})
    with pytest.raises(ConfigError, match="training.warm_idle_s must be > 0 seconds"):
        load_agent_config(agent_config)
