"""A state directory that cannot be written when a round closes: the previous model stays in
force, "disk" is said in the log and status, and the round closes once the disk is back. Real failures: a
directory stands where the server must write a file (as root, permissions would not stop a write)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from broker_server.rounds.disk import DiskError
from broker_server.rounds.engine import RoundEngine
from protocol.messages import ServerStatus
from security.replay import ReplayGuard
from tests.fedharness import ServerHarness, wait_until
from tests.fixtures import completed, open_round, state_json

AGENTS = ["agent-01", "agent-02", "agent-03"]


def block(path) -> None:  # noqa: ANN001
    """Make writing ``path`` fail for real: a directory stands in its place (EISDIR)."""
    path.mkdir()
    (path / "keep").write_text("")  # not empty: nothing can replace it


def unblock(path) -> None:  # noqa: ANN001
    shutil.rmtree(path)


def written_updates(server_config) -> list[str]:  # noqa: ANN001
    """The agents whose updates the checkpoint on disk holds (memory may hold one a moment earlier)."""
    return [u["agent"] for u in state_json(server_config)["round_state"]["updates"]]


def test_a_round_close_that_cannot_be_written_leaves_the_previous_model_and_round_in_force(config):  # noqa: F811
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(engine)
    for i, agent in enumerate(AGENTS):
        engine.accept(completed(engine, agent, seed=i))
    before = {k: v.copy() for k, v in engine.global_arrays.items()}
    blocked = config.state_dir / "checkpoint" / "global-v2.safetensors"
    block(blocked)

    said = f"disk: round 1 close not written, will retry: \\[Errno 21\\] Is a directory: '{blocked}'"
    with pytest.raises(DiskError, match=said):
        with engine.state.durably("round 1 close"):
            engine.close(now=1.0, model_wire_bytes=0)
    assert engine.version == 1 and engine.next_round == 1  # memory is what the disk holds
    assert engine.round_state is not None and engine.round_state.accepted == AGENTS
    assert all(np.array_equal(engine.global_arrays[k], v) for k, v in before.items())
    assert state_json(config)["model_version"] == 1 and state_json(config)["round_state"]["round"] == 1
    assert not (config.state_dir / "metrics.jsonl").exists()

    unblock(blocked)  # the disk is back: the same round closes, from the stored updates
    with engine.state.durably("round 1 close"):
        metrics = engine.close(now=2.0, model_wire_bytes=0)
    reference = RoundEngine(config, replay=ReplayGuard(3600))  # what a restart resumes: the same
    assert metrics.outcome == "committed" and metrics.round == 1 and engine.version == 2
    assert reference.version == 2 and reference.round_state is None
    for name, value in engine.global_arrays.items():
        np.testing.assert_array_equal(reference.global_arrays[name], value, err_msg=name)
    open_round(engine)  # and the next round accepts updates against the new model (not ``stale-base``)
    assert engine.accept(completed(engine, "agent-01", seed=9)).agent == "agent-01"


def test_an_accepted_update_that_cannot_be_written_is_not_kept_in_memory(config):  # noqa: F811
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(engine)
    engine.accept(completed(engine, "agent-01", seed=0))
    checkpoint_dir = config.state_dir / "checkpoint"
    checkpoint_dir.rename(config.state_dir / "moved")
    checkpoint_dir.write_text("not a directory")  # nothing under it can be written
    with pytest.raises(DiskError, match="disk: update of agent-02 not written"):
        with engine.state.durably("update of agent-02"):
            engine.accept(completed(engine, "agent-02", seed=1))
    assert engine.round_state.accepted == ["agent-01"]
    checkpoint_dir.unlink()
    (config.state_dir / "moved").rename(checkpoint_dir)
    with engine.state.durably("update of agent-02"):
        engine.accept(completed(engine, "agent-02", seed=1))
    assert RoundEngine(config, replay=ReplayGuard(3600)).round_state.accepted == ["agent-01", "agent-02"]


def test_metrics_and_the_model_file_that_cannot_be_written_follow_the_checkpoint_later(config):  # noqa: F811
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    open_round(engine)
    for i, agent in enumerate(AGENTS):
        engine.accept(completed(engine, agent, seed=i))
    metrics_path, model_path = config.state_dir / "metrics.jsonl", config.state_dir / "global_model.safetensors"
    model_path.unlink()
    block(metrics_path)
    block(model_path)
    engine.close(now=1.0, model_wire_bytes=0)  # committed: the checkpoint is written, the outputs lag
    assert engine.version == 2 and state_json(config)["model_version"] == 2
    assert engine.state.outputs_pending == {"metrics", "model"}
    with pytest.raises(DiskError, match="disk: metrics.jsonl"):
        engine.state.flush_outputs()
    unblock(metrics_path)
    unblock(model_path)
    engine.state.flush_outputs()
    assert engine.state.outputs_pending == set()
    assert [json.loads(line)["round"] for line in metrics_path.read_text().splitlines()] == [1]
    assert model_path.stat().st_size > 0


def test_the_daemon_says_disk_and_closes_the_round_once_the_disk_is_back(tmp_path, broker, caplog):
    with ServerHarness(tmp_path, broker, agents=2, rounds=2) as h:
        h.announce_agents()
        blocked = h.config.state_dir / "checkpoint" / "global-v2.safetensors"
        block(blocked)
        deltas = [h.random_delta(1), h.random_delta(2)]
        h.send("agent-01", deltas[0])
        h.send("agent-02", deltas[1])
        status = wait_until(lambda: h.server.disk.problem, what="the disk problem")
        assert "disk: round 1 close not written, will retry" in status and str(blocked) in status
        published = ServerStatus.from_json(h.server.report.json())
        assert published.detail.startswith("disk: round 1 close") and published.model_version == 1
        assert any("disk: round 1 close not written" in r.getMessage() for r in caplog.records)
        assert h.metrics == [] and h.server.engine.version == 1

        unblock(blocked)
        first = h.wait_metrics(1)
        assert first.round == 1 and first.outcome == "committed" and first.model_version == 2
        assert any("disk writable again" in r.getMessage() for r in caplog.records)
        wait_until(lambda: h.tasks and h.tasks[-1].round == 2, what="round 2's task")
        h.send("agent-01", h.random_delta(3), round_number=2)  # against version 2: accepted, not stale-base
        h.send("agent-02", h.random_delta(4), round_number=2)
        second = h.wait_metrics(2)
        assert second.round == 2 and second.outcome == "committed" and second.accepted == ["agent-01", "agent-02"]
        assert h.server.disk.problem == "" and h.server.rejections == {}
    said = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("disk: round 1 close not written") for m in said) == 1  # said once, retried quietly
    assert sum(m.startswith("disk writable again") for m in said) == 1


def test_an_update_that_could_not_be_written_is_accepted_once_the_disk_is_back(tmp_path, broker):
    with ServerHarness(tmp_path, broker, agents=2, rounds=1) as h:
        h.announce_agents()
        h.send("agent-01", h.random_delta(1))
        wait_until(lambda: written_updates(h.config) == ["agent-01"], what="agent-01's update, written")
        checkpoint_dir, aside = h.config.state_dir / "checkpoint", h.config.state_dir / "aside"
        checkpoint_dir.rename(aside)
        checkpoint_dir.write_text("the disk is gone")  # nothing under it can be written
        h.send("agent-02", h.random_delta(2))
        wait_until(lambda: "disk: update of agent-02 not written" in h.server.disk.problem, what="the disk problem")
        assert h.server.engine.round_state.accepted == ["agent-01"]
        checkpoint_dir.unlink()
        aside.rename(checkpoint_dir)
        metrics = h.wait_metrics(1)  # the agent sent nothing again: the server kept the update it could not write
        assert "agent-02" not in h.server.intake.unsaved
        assert metrics.outcome == "committed" and metrics.accepted == ["agent-01", "agent-02"]
