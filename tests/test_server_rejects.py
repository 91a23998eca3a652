"""Bad input at the aggregator, over a real broker: each kind is rejected with a reason, counted, and
leaves the global model exactly the FedAvg of the valid updates."""

import numpy as np
import pytest

from security.keys import Identity
from tests.fedharness import ServerHarness, wait_until


def _flip_last_byte(chunks):
    return [*chunks[:-1], chunks[-1][:-1] + bytes([chunks[-1][-1] ^ 1])]


def corrupt_chunk(h, good):
    h.publish_update("agent-01", _flip_last_byte(h.sealed(h.agents["agent-01"], good)))
    return "bad-chunk"


def unknown_sender(h, good):
    h.publish_update("intruder", h.sealed(Identity.generate("intruder"), good))
    return "unknown-sender"


def forged_key(h, good):
    h.publish_update("agent-01", h.sealed(Identity.generate("agent-01"), good))
    return "bad-signature"


def other_round(h, good):
    h.publish_update(
        "agent-01", h.sealed(h.agents["agent-01"], h.update_bytes(h.random_delta(9), round_number=2), round_number=2)
    )
    return "wrong-round"


def other_federation(h, good):
    h.publish_update("agent-01", h.sealed(h.agents["agent-01"], good, federation="elsewhere"))
    return "wrong-federation"


def topic_of_another_agent(h, good):
    h.publish_update("agent-02", h.sealed(h.agents["agent-01"], good))
    return "sender-mismatch"


def nan_values(h, good):
    delta = h.random_delta(5)
    name = next(iter(delta))
    delta[name].flat[0] = np.nan
    h.publish_update("agent-01", h.sealed(h.agents["agent-01"], h.update_bytes(delta)))
    return "non-finite-values"


def infinite_values(h, good):
    delta = h.random_delta(5)
    delta[next(iter(delta))].flat[-1] = -np.inf
    h.publish_update("agent-01", h.sealed(h.agents["agent-01"], h.update_bytes(delta)))
    return "non-finite-values"


def wrong_names(h, good):
    delta = h.random_delta(6)
    name = next(iter(delta))
    delta["renamed." + name] = delta.pop(name)
    h.publish_update("agent-01", h.sealed(h.agents["agent-01"], h.update_bytes(delta)))
    return "wrong-tensors"


def wrong_shape(h, good):
    delta = h.random_delta(7)
    name = next(iter(delta))
    delta[name] = delta[name].reshape(-1)[:-1].copy()
    h.publish_update("agent-01", h.sealed(h.agents["agent-01"], h.update_bytes(delta)))
    return "wrong-tensors"


def not_safetensors(h, good):
    h.publish_update("agent-01", h.sealed(h.agents["agent-01"], b"\x80\x04pickle-bytes-are-never-loaded"))
    return "malformed-update"


def too_large(h, good):
    h.publish_update("agent-01", h.sealed(h.agents["agent-01"], bytes(3 << 20)))
    return "too-large"


def garbage_payload(h, good):
    h.publish_update("agent-01", [b"SKF\x01" + bytes(100), b"hello", b""])
    return "malformed"


CASES = [
    corrupt_chunk,
    unknown_sender,
    forged_key,
    other_round,
    other_federation,
    topic_of_another_agent,
    nan_values,
    infinite_values,
    wrong_names,
    wrong_shape,
    not_safetensors,
    too_large,
    garbage_payload,
]


@pytest.mark.parametrize("attack", CASES, ids=[c.__name__ for c in CASES])
def test_bad_update_is_rejected_and_global_model_is_fedavg_of_valid_updates(tmp_path, broker, attack):
    with ServerHarness(tmp_path, broker, limits={"max_transfer_mb": 2.0}) as h:
        h.announce_agents()
        deltas = [h.random_delta(1), h.random_delta(2)]
        good = [h.update_bytes(deltas[0], samples=100), h.update_bytes(deltas[1], samples=100)]  # of two: equal
        reason = attack(h, good[0])
        h.wait_rejection(reason)
        h.publish_update("agent-01", h.sealed(h.agents["agent-01"], good[0]))
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], good[1]))
        metrics = h.wait_metrics()
        assert sorted(metrics.accepted) == ["agent-01", "agent-02"]
        assert any(r.reason.startswith(reason) for r in metrics.rejected), metrics.rejected
        final = h.final_model()
    expected = h.expected_model(deltas, [100, 100])
    assert final.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(final[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_replayed_and_duplicate_updates_are_rejected(tmp_path, broker):
    with ServerHarness(tmp_path, broker) as h:
        h.announce_agents()
        deltas = [h.random_delta(1), h.random_delta(2)]
        chunks = h.sealed(h.agents["agent-01"], h.update_bytes(deltas[0]))
        h.publish_update("agent-01", chunks)
        h.publish_update("agent-01", chunks)  # the same bytes again: a replay
        h.wait_rejection("replay")
        h.publish_update("agent-01", h.sealed(h.agents["agent-01"], h.update_bytes(h.random_delta(3))))
        h.wait_rejection("duplicate")
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], h.update_bytes(deltas[1])))
        metrics = h.wait_metrics()
        reasons = {r.reason for r in metrics.rejected}
        assert {"replay", "duplicate"} <= reasons
        final = h.final_model()
    expected = h.expected_model(deltas, [100, 100])
    for name in expected:
        np.testing.assert_allclose(final[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_flood_of_unfinished_transfers_is_bounded_and_expires(tmp_path, broker):
    with ServerHarness(tmp_path, broker, limits={"max_partial_per_agent": 2, "partial_timeout_s": 1.0}) as h:
        h.announce_agents()
        blob = h.update_bytes(h.random_delta(4))
        for age_s in range(1, 7):  # first chunk only of six multi-chunk transfers, each older: none supersedes
            h.publish_update("agent-01", h.sealed(h.agents["agent-01"], blob, chunk_size=4096, age_s=age_s)[:1])
        wait_until(lambda: h.server.rejections["too-many-partial-transfers"] == 4, what="4 refused transfers")
        h.wait_rejection("transfer-timeout")
        assert h.server.reassembler.pending_bytes() == 0
        deltas = [h.random_delta(1), h.random_delta(2)]
        h.publish_update("agent-01", h.sealed(h.agents["agent-01"], h.update_bytes(deltas[0])))
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], h.update_bytes(deltas[1])))
        metrics = h.wait_metrics()
        assert sorted(metrics.accepted) == ["agent-01", "agent-02"]


def test_a_forged_chunk_inside_an_honest_update_does_not_void_it(tmp_path, broker):
    with ServerHarness(tmp_path, broker) as h:
        h.announce_agents()
        deltas = [h.random_delta(1), h.random_delta(2)]
        chunks = h.sealed(h.agents["agent-01"], h.update_bytes(deltas[0]), chunk_size=16 << 10)
        assert len(chunks) > 3
        h.publish_update("agent-01", chunks[:1])
        forged = bytearray(chunks[2])
        forged[-40] ^= 0xFF  # an outsider copied the signed manifest and sends garbage at index 2
        h.publish_update("agent-01", [bytes(forged)])
        h.wait_rejection("bad-chunk")
        h.publish_update("agent-01", chunks[1:])
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], h.update_bytes(deltas[1])))
        metrics = h.wait_metrics()
        final = h.final_model()
    assert sorted(metrics.accepted) == ["agent-01", "agent-02"]
    expected = h.expected_model(deltas, [100, 100])
    for name in expected:
        np.testing.assert_allclose(final[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_replay_after_a_server_restart_is_still_refused_as_a_replay(tmp_path, broker):
    with ServerHarness(tmp_path, broker) as h:
        h.announce_agents()
        chunks = h.sealed(h.agents["agent-01"], h.update_bytes(h.random_delta(1)))
        h.publish_update("agent-01", chunks)
        wait_until(lambda: h.server.engine.round_state.accepted == ["agent-01"], what="agent-01 accepted")
        h.restart_server()
        wait_until(lambda: h.server.phase == "training", what="the restarted server to re-announce")
        h.publish_update("agent-01", chunks)
        h.wait_rejection("replay")
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], h.update_bytes(h.random_delta(2))))
        metrics = h.wait_metrics()
    assert sorted(metrics.accepted) == ["agent-01", "agent-02"]
    assert "replay" in {r.reason for r in metrics.rejected}


def test_claims_larger_than_the_models_update_are_refused_before_any_memory_is_committed(tmp_path, broker):
    with ServerHarness(tmp_path, broker) as h:
        h.announce_agents()
        for _ in range(2):  # first chunk only of two 64 MiB transfers: today they would pin 128 MiB
            h.publish_update("agent-01", h.sealed(h.agents["agent-01"], bytes(64 << 20))[:1])
        wait_until(lambda: h.server.rejections["too-large"] == 2, what="two too-large refusals")
        assert h.server.reassembler.pending_bytes() == 0
        h.publish_update("agent-01", h.sealed(h.agents["agent-01"], h.update_bytes(h.random_delta(1))))
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], h.update_bytes(h.random_delta(2))))
        metrics = h.wait_metrics()
    assert sorted(metrics.accepted) == ["agent-01", "agent-02"]


def test_junk_under_invented_agent_ids_is_summarised_and_cannot_crowd_out_real_rejections(tmp_path, broker):
    with ServerHarness(tmp_path, broker) as h:
        h.announce_agents()
        for i in range(250):  # an outsider inventing topic ids
            h.driver.publish(h.topics.agent_update(f"ghost{i}"), b"SKF\x01" + bytes(64))
        wait_until(lambda: h.server.rejections["malformed"] >= 250, what="250 refusals")
        h.publish_update("agent-01", _flip_last_byte(h.sealed(h.agents["agent-01"], h.update_bytes(h.random_delta(9)))))
        h.wait_rejection("bad-chunk")
        h.publish_update("agent-01", h.sealed(h.agents["agent-01"], h.update_bytes(h.random_delta(1))))
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], h.update_bytes(h.random_delta(2))))
        metrics = h.wait_metrics()
    pairs = [(r.agent, r.reason) for r in metrics.rejected]
    assert ("(not enrolled)", "malformed") in pairs and ("agent-01", "bad-chunk") in pairs
    assert len(pairs) < 10
