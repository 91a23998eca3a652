"""What a hostile review of the fleet-fault mechanisms found an enrolled agent gone rogue could do, each pinned:
junk updates must not cost a state write each, its own refusal texts must not crowd out others', a
clock flapping across the tolerance must not flood the log, flipping its status must not restart its
model re-send pace, and a revoked agent's unfinished transfers are freed at once."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from broker_server.agents.model_resend import MODEL_STALL_S, ModelWaits
from broker_server.agents.registry import OFFSET_SAMPLES, AgentRegistry, StatusRefused
from protocol.messages import AgentStatus
from security.keys import Identity, Keyring, revoke
from security.signing import signed_payload
from tests.fedharness import ServerHarness, wait_until


def nan_update(h: ServerHarness, seed: int) -> bytes:
    delta = h.random_delta(seed)
    delta[next(iter(delta))].flat[0] = np.nan
    return h.update_bytes(delta)


def test_a_flood_of_refused_updates_is_one_failure_one_write_and_a_few_listed_reasons(tmp_path, broker):
    with ServerHarness(tmp_path, broker) as h:
        h.announce_agents()
        engine = h.server.engine
        rogue = h.agents["agent-01"]
        h.publish_update("agent-01", h.sealed(rogue, nan_update(h, 1)))
        wait_until(lambda: engine.round_state is not None and "agent-01" in engine.round_state.failed, 20, "refused")
        writes = engine.state.writes
        for seed in range(2, 42):  # 40 more junk updates, each a different transfer
            h.publish_update("agent-01", h.sealed(rogue, nan_update(h, seed)))
        h.publish_update("agent-01", h.sealed(Identity.generate("agent-01"), nan_update(h, 99)))  # another kind
        wait_until(lambda: h.server.rejections["non-finite-values"] >= 41, 60, "every junk update refused")
        rs = engine.round_state
        assert rs.failed == ["agent-01"]  # listed once, not 41 times
        assert engine.state.writes - writes <= 2  # not one checkpoint per refusal (41 before): nothing changed
        own = [r for r in rs.rejected if r["agent"] == "agent-01"]
        assert 1 <= len(own) <= 3 and len({r["reason"].split(":")[0] for r in own}) == len(own)


def test_a_clock_flapping_across_the_tolerance_is_reported_once(caplog):
    identity = Identity.generate("rogue")
    registry = AgentRegistry(Keyring([identity.public]), status_timeout_s=60)
    caplog.set_level(logging.INFO, logger="skyfed.server")
    now = time.time()
    for i in range(40):  # +30.5 s, +29.5 s, ... : crossing the 30 s line on every status
        offset = 30.5 if i % 2 == 0 else 29.5
        status = AgentStatus(agent="rogue", state="idle", round=0, samples=1, version=1,
                             updated_at=now + 2 * i + offset)  # fmt: skip
        registry.update("rogue", signed_payload(status.to_dict(), identity), now + 2 * i)
    said = [r.getMessage() for r in caplog.records if "clock skew" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("clock skew agent=rogue offset_s=+30.5"), said
    assert list(registry.clock_offsets()) == ["rogue"]
    for i in range(OFFSET_SAMPLES):  # its clock fixed: gone once every sample of the estimate says so
        assert list(registry.clock_offsets()) == ["rogue"]
        back = AgentStatus(agent="rogue", state="idle", round=0, samples=1, version=1, updated_at=now + 200 + i)
        registry.update("rogue", signed_payload(back.to_dict(), identity), now + 200 + i)
    assert registry.clock_offsets() == {} and "clock skew gone agent=rogue" in caplog.records[-1].getMessage()


def test_statuses_queued_through_a_broker_outage_do_not_make_a_healthy_clock_look_skewed(caplog):
    """An agent publishes a status every 10 s; for 60 s the broker is down and its client queues them, then
    delivers the six at once. On main each late one was read as a clock 10 … 60 s behind: a false warning."""
    identity = Identity.generate("drone")
    registry = AgentRegistry(Keyring([identity.public]), status_timeout_s=60)
    caplog.set_level(logging.INFO, logger="skyfed.server")

    def status(signed_at: float, received_at: float) -> None:
        sent = AgentStatus(agent="drone", state="idle", round=0, samples=1, version=1, updated_at=signed_at)
        registry.update("drone", signed_payload(sent.to_dict(), identity), received_at)

    for t in range(0, 100, 10):  # healthy: delivered within 0.2 s
        status(t, t + 0.2)
    for t in range(100, 160, 10):  # queued while the broker was down, delivered when it is back
        status(t, 160.5)
    for t in range(160, 200, 10):
        status(t, t + 0.2)
    assert registry.clock_offsets() == {} and "clock skew" not in caplog.text
    for t in range(300, 400, 10):  # a clock that really runs 60 s behind is still told at once
        status(t - 60, t + 0.2)
    assert list(registry.clock_offsets()) == ["drone"] and caplog.text.count("clock skew agent=drone") == 1


def test_flipping_its_status_does_not_restart_an_agents_model_resend_pace():
    waits, now, sent = ModelWaits(), 0.0, 0
    for step in range(600):  # 10 minutes: waiting-model, then training, then waiting-model again ...
        now = float(step)
        waits.note("rogue", waiting=step % 20 < 16, now=now)
        sent += len(waits.due(now, ["rogue"]))
    assert sent <= 6, sent  # 15 s, then 30, 60, 120, 240 s apart: not one every ~15 s (34 before)
    assert MODEL_STALL_S == 15.0


def test_revocation_frees_the_agents_unfinished_transfers(tmp_path, broker):
    with ServerHarness(tmp_path, broker) as h:
        h.announce_agents()
        chunks = h.sealed(h.agents["agent-01"], h.update_bytes(h.random_delta(1)), chunk_size=4096)
        h.publish_update("agent-01", chunks[:1])  # one chunk of many: an unfinished transfer
        reassembler = h.server.reassembler
        wait_until(lambda: reassembler.pending_bytes() > 0, 20, "the partial transfer held")
        revoke(h.layout.server_config.parent / "enrolled", "agent-01")  # as `skyfed keys revoke` does
        wait_until(lambda: reassembler.pending_bytes() == 0, 20, "its unfinished transfer freed at once")


def test_clearing_a_status_does_not_reopen_it_to_replays():
    """An empty retained payload (anyone the ACL lets publish there) clears an agent's status unsigned; a
    replay of its old signed status or will right after must still be refused."""
    identity = Identity.generate("agent")
    registry = AgentRegistry(Keyring([identity.public]), status_timeout_s=60)
    now = time.time()

    def signed(state: str, at: float, session: float) -> bytes:
        status = AgentStatus(agent="agent", state=state, round=0, samples=1, version=1, updated_at=at, session=session)
        return signed_payload(status.to_dict(), identity)

    old_ready, old_will = signed("idle", now - 50, now - 100), signed("offline", now - 100, now - 100)
    registry.update("agent", old_ready, now - 50)
    registry.update("agent", signed("idle", now, now - 10), now)  # a newer connection, a newer status
    registry.update("agent", b"", now + 1)  # cleared
    for replay in (old_ready, old_will, old_ready):
        with pytest.raises(StatusRefused):
            registry.update("agent", replay, now + 2)
    registry.update("agent", signed("idle", now + 3, now - 10), now + 3)  # the agent's own next status is fine


def test_agents_online_counts_only_agents_whose_status_is_recent_and_not_offline():
    """Found by the operator review: the monitor's "agents online" counted agents whose last status was
    long gone (shown with an age of minutes), as long as that status was not "offline"."""
    identity = Identity.generate("agent")
    registry = AgentRegistry(Keyring([identity.public]), status_timeout_s=60)
    now = time.time()
    status = AgentStatus(agent="agent", state="idle", round=0, samples=1, version=1, updated_at=now)
    registry.update("agent", signed_payload(status.to_dict(), identity), now)
    assert registry.online(now + 30) == 1 and registry.online(now + 61) == 0


def test_reassembly_memory_goes_only_to_updates_the_open_round_waits_for(tmp_path, broker):
    """Found by the hostile review: any enrolled agent could open update transfers for rounds that were not
    open, trickle their chunks and hold the server's shared pending-transfer memory. Now a transfer opens
    only for a pending agent of the open round, a refused transfer's other chunks cost nothing more, and
    an unfinished update of a closed round is freed at the close, not after its time-out (where late updates are
    refused: with ``late_weight`` > 0 the agent's update is still welcome in the next round)."""
    with ServerHarness(tmp_path, broker, agents=3, strategy={"name": "fedavg", "threshold": 2, "late_weight": 0}) as h:
        h.announce_agents()
        server = h.server
        small = 4096  # many chunks per update
        wrong = h.sealed(h.agents["agent-01"], h.update_bytes(h.random_delta(1), round_number=5), round_number=5,
                         chunk_size=small)  # fmt: skip
        h.publish_update("agent-01", wrong[:-1])  # every chunk but the last: on main, a slot held for 120 s
        h.wait_rejection("wrong-round")
        slow = h.sealed(h.agents["agent-03"], h.update_bytes(h.random_delta(3)), chunk_size=small)
        h.publish_update("agent-03", slow[:-1])  # a pending agent's unfinished update: admitted
        wait_until(lambda: server.reassembler.pending_bytes() > 0, 20, "agent-03's transfer opened")
        h.send("agent-01", h.random_delta(11))
        h.send("agent-02", h.random_delta(12))
        metrics = h.wait_metrics(1)
        assert sorted(metrics.accepted) == ["agent-01", "agent-02"]
        wait_until(lambda: server.reassembler.pending_bytes() == 0, 10, "the closed round's transfer freed")
        assert server.rejections["wrong-round"] == 1, server.rejections  # one refusal for the whole transfer
        assert len(wrong) > 10
