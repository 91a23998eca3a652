"""An agent's model transfers cannot be wedged: tampered copies of genuine chunks open no
slot, old or unfinished transfers give way to newer ones or time out, and a genuine model gets through.

Every chunk here is sealed for real with the server's key and the group key: the "old" ones stand in for
chunks an outsider copied off the broker earlier (their signed manifests verify; no key is needed to
flip a byte of the ciphertext)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from agent.inbox import MODEL_LIMITS, ServerInbox
from models.serialization import dumps
from participant.progress import ProgressStore
from participant.start_models import StartModels
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import Topics
from security.envelope import seal
from security.keys import GroupKey, Identity
from sim.federation import SimSettings, create_federation
from tests.fedharness import hosted_agent, wait_until

MODEL = frozenset({"model"})
SLOTS = MODEL_LIMITS.max_partial_per_sender  # 4: what the lock-out on main filled


def model_chunks(server: Identity, group: GroupKey, version: int, *, age_s: float = 0.0) -> list[bytearray]:
    """A real serialized model of ``version``, sealed as the server publishes it (about 10 chunks)."""
    arrays = {"w": np.full((10, 1000), version, dtype=np.float32)}
    return seal(dumps(arrays), sender=server, federation="it", kind="model", round=version, group_key=group,
                chunk_size=4096, now=time.time() - age_s)[1]  # fmt: skip


def tampered(chunk: bytearray) -> bytes:
    """A genuine chunk with one ciphertext byte flipped: its manifest and signature still verify."""
    copy = bytearray(chunk)
    copy[-20] ^= 0x01
    return bytes(copy)


@pytest.fixture
def keys():
    return Identity.generate("server"), Identity.generate("agent-01"), GroupKey.generate()


@pytest.fixture
def inbox(tmp_path, keys):
    server, agent, group = keys
    warnings: list[str] = []
    box = ServerInbox(agent, server.public, "it", StartModels(ProgressStore(tmp_path)),
                      lambda key, message, *args: warnings.append(message % args))  # fmt: skip
    box.group_keys[group.key_id] = group
    box.warnings = warnings  # type: ignore[attr-defined]
    return box


def feed_all(box: ServerInbox, chunks: list[bytearray], version: int) -> list[str]:
    return [box.feed(bytes(c), MODEL, version, None) for c in chunks]


def test_tampered_copies_of_old_chunks_open_no_slot_and_the_next_model_gets_through(inbox, keys):
    server, _, group = keys
    for version in range(1, SLOTS + 1):  # one more than main survived: 4 filled every slot for good
        assert inbox.feed(tampered(model_chunks(server, group, version, age_s=600)[1]), MODEL, version, None) == ""
    assert inbox.warnings.count("transfer rejected kind=model reason=bad-chunk") == SLOTS
    assert inbox.reassembler.pending_bytes() == 0
    assert feed_all(inbox, model_chunks(server, group, 5), 5)[-1] == "model"
    assert set(inbox.models) == {5} and float(inbox.models[5]["w"][0, 0]) == 5.0


def test_genuine_old_chunks_replayed_give_way_to_a_newer_model(inbox, keys):
    """Untampered first chunks of old transfers authenticate and fill every slot (newest first, so none
    supersedes another); the genuine current model supersedes them all."""
    server, _, group = keys
    for version, age_s in zip(range(1, SLOTS + 1), (100, 200, 300, 400), strict=True):
        assert inbox.feed(bytes(model_chunks(server, group, version, age_s=age_s)[0]), MODEL, version, None) == ""
    assert inbox.warnings == []  # every slot is held now
    older = model_chunks(server, group, 9, age_s=500)[0]
    assert inbox.feed(bytes(older), MODEL, 9, None) == ""  # older than all: it supersedes nothing, finds no slot
    assert inbox.warnings == ["transfer rejected kind=model reason=too-many-partial-transfers"]
    assert feed_all(inbox, model_chunks(server, group, 5), 5)[-1] == "model"
    assert set(inbox.models) == {5} and inbox.reassembler.pending_bytes() == 0


def test_a_real_agent_over_a_real_broker_is_not_locked_out_and_expires_what_stopped_arriving(tmp_path, broker):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), (broker.host, broker.port))
    server = Identity.load(layout.server_config.parent / "server.key")
    agent_identity = Identity.load(tmp_path / "agent-01" / "agent-01.key")
    group, topics = GroupKey.generate(), Topics("it")
    agent, stop = hosted_agent(layout.agent_configs["agent-01"]), threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    driver = MqttClient("test-server", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
    driver.subscribe(topics.agent_status("agent-01"))
    assert driver.start(timeout_s=10)
    thread.start()
    try:
        wait_until(lambda: driver.poll(0.1), 20, "the agent's status (sent after it subscribed)")
        _, key_chunks = seal(group.to_bytes(), sender=server, federation="it", kind="groupkey", round=0,
                             recipient=agent_identity.public)  # fmt: skip
        driver.publish_all((topics.agent_inbox("agent-01"), c) for c in key_chunks)
        # the status naming the key is published after the model subscription it triggers
        wait_until(lambda: (m := driver.poll(0.1)) and group.key_id.encode() in m[1], 20, "the group key")
        for version in range(1, SLOTS + 1):
            chunk = tampered(model_chunks(server, group, version, age_s=600)[0])
            driver.publish(topics.model_chunk(version, 0), chunk)
        genuine = model_chunks(server, group, 5)
        driver.publish_all(((topics.model_chunk(5, i), c) for i, c in enumerate(genuine)), retain=True)
        wait_until(lambda: 5 in agent.models, 20, "the genuine model after 4 tampered chunks")
        # No attacker: a newer transfer that stops arriving (its other chunks lost) is freed by the agent's tick.
        driver.publish(topics.model_chunk(6, 0), bytes(model_chunks(server, group, 6)[0]))
        wait_until(lambda: agent.inbox.reassembler.pending_bytes() > 0, 20, "the unfinished transfer to start")
        agent.inbox.reassembler.clock = lambda: time.monotonic() + MODEL_LIMITS.partial_timeout_s + 1
        wait_until(lambda: agent.inbox.reassembler.pending_bytes() == 0, 20, "the agent to expire it")
    finally:
        stop.set()
        thread.join(10)
        driver.stop(5)
