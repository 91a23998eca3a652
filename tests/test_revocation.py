"""Revoking an agent mid-round: its part in the round ends at once (the round closes on the
others' updates instead of waiting for its deadline), the metrics list it as missed with a `revoked`
rejection, and the agent — told by the server's signed round task — stops training and sending."""

from __future__ import annotations

import logging
import shutil
import threading
import time

import numpy as np
import pytest

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from broker_server.rounds.engine import RoundEngine
from flcore.update import NotForThisRound
from participant.trainer import TrainerWrapper
from security.keys import revoke
from security.replay import ReplayGuard
from tests.fedharness import Federation, override_toml, round_task, wait_until
from tests.fixtures import completed, open_round

DEADLINE_S = 120.0


class HeldUp(TrainerWrapper):
    """Trains only once ``release`` is set: the agent is still pending when it is revoked."""

    release = threading.Event()

    def train(self, global_arrays, task, context=None):  # noqa: ANN001, ANN201
        self.release.wait(60)
        return self.inner.train(global_arrays, task)


def test_a_revoked_agent_no_longer_holds_up_the_round_and_stops_when_told(tmp_path, broker, caplog):
    caplog.set_level(logging.INFO)
    fed = Federation(tmp_path, broker, rounds=1, agents=3)
    override_toml(fed.layout.server_config, rounds={"min_agents": 3, "quorum": 2, "deadline_s": DEADLINE_S})
    revoked = fed.agents[2]
    revoked.runner.trainer = HeldUp(revoked.runner.trainer)
    server = Aggregator(load_server_config(fed.layout.server_config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    fed.start_agents()
    try:
        wait_until(lambda: server.engine.round_state is not None and len(server.engine.round_state.accepted) == 2,
                   60, "the two other agents' updates")  # fmt: skip
        assert server.engine.round_state.pending == ["agent-03"] and revoked.state == "training"
        revoked_at = time.monotonic()
        revoke(fed.layout.server_config.parent / "enrolled", "agent-03")  # as `skyfed keys revoke` does
        thread.join(30)
        assert not thread.is_alive(), "the round waited for the revoked agent"
        assert time.monotonic() - revoked_at < 10  # against a deadline of 120 s
        wait_until(lambda: revoked.revoked, 10, "the agent to hear of its revocation")
        HeldUp.release.set()
        wait_until(lambda: revoked.state == "revoked", 10, "the revoked agent to stop")
    finally:
        HeldUp.release.set()
        fed.close()
    (metrics,) = fed.metrics()
    assert metrics.outcome == "committed" and sorted(metrics.accepted) == ["agent-01", "agent-02"]
    assert metrics.missed == ["agent-03"]
    assert [r.agent for r in metrics.rejected if r.reason.startswith("revoked")] == ["agent-03"]
    assert revoked.client.progress.sent_round == 0 and revoked.client.upload is None  # it never sent its update
    said = [r.getMessage() for r in caplog.records if r.name == "skyfed.agent"]
    assert sum(m.startswith("revoked by the server: its enrolment was withdrawn") for m in said) == 1
    assert any("training stopped round=1" in m and "revoked by the server" in m for m in said)


def test_a_revoked_agents_accepted_update_is_left_out_of_the_average(config):  # noqa: F811
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(engine)
    for i, agent in enumerate(["agent-01", "agent-02", "agent-03"]):
        engine.accept(completed(engine, agent, seed=i))
    assert engine.fleet.revoke("agent-02") and engine.round_state.pending == []
    with pytest.raises(NotForThisRound, match="revoked"):  # one completed just before the revocation
        engine.accept(completed(engine, "agent-02", seed=1))
    resumed = RoundEngine(config, replay=ReplayGuard(3600))
    assert resumed.round_state.revoked == ["agent-02"] and resumed.round_state.missed == ["agent-02"]
    metrics = engine.close(now=1.0, model_wire_bytes=0)
    assert metrics.accepted == ["agent-01", "agent-03"] and metrics.missed == ["agent-02"]
    assert metrics.rejected[0].agent == "agent-02" and metrics.rejected[0].reason.startswith("revoked")

    for path in (config.state_dir / "checkpoint", config.state_dir / "metrics.jsonl"):  # the same round without it
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    without = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(without)
    for i, agent in [(0, "agent-01"), (2, "agent-03")]:
        without.accept(completed(without, agent, seed=i))
    without.round_state.missed.append("agent-02")
    without.close(now=1.0, model_wire_bytes=0)
    for name, value in without.global_arrays.items():
        np.testing.assert_allclose(engine.global_arrays[name], value, rtol=1e-6, atol=1e-8, err_msg=name)


def test_a_task_issued_again_within_its_attempt_is_newer_and_a_replay_of_the_first_issue_is_not():
    first = round_task(run_id="r", issued_at=100.0)
    again = round_task(run_id="r", issued_at=101.0, revoked=["agent-02"])
    assert again.is_newer_than(first) and not first.is_newer_than(again)
