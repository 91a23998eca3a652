"""Chunk reassembly: any order, duplicates, whole-transfer integrity, and the hard limits."""

import os
import random

import pytest

from protocol.transfer import Reassembler, TransferLimits, TransferRejected
from security.envelope import Opener, seal
from security.keys import Identity, Keyring

UPDATE = frozenset({"update"})


@pytest.fixture(scope="module")
def ids():
    return Identity.generate("server"), Identity.generate("agent")


def make(ids, limits=TransferLimits(), clock=None):
    server, agent = ids
    opener = Opener(identity=server, federation="f", senders=Keyring([agent.public]))
    return Reassembler(opener, limits, **({"clock": clock} if clock else {}))


def chunks_of(ids, data, chunk_size=1024):
    server, agent = ids
    return seal(
        data, sender=agent, federation="f", kind="update", round=1, recipient=server.public, chunk_size=chunk_size
    )[1]


def test_reassembles_shuffled_and_duplicated_chunks(ids):
    data = os.urandom(10_000)
    chunks = chunks_of(ids, data)
    order = chunks[:-1] + chunks[:3]
    random.Random(1).shuffle(order)
    order.append(chunks[-1])  # after completion a re-delivery counts as a replay (next test)
    r = make(ids)
    done = [c for c in (r.feed(p, topic_sender="agent", kinds=UPDATE) for p in order) if c is not None]
    assert len(done) == 1 and bytes(done[0].data) == data
    assert done[0].wire_bytes == sum(map(len, chunks))
    assert r.pending_bytes() == 0


def test_size_and_chunk_count_limits_are_checked_before_allocating(ids):
    with pytest.raises(TransferRejected, match="too-large"):
        make(ids, TransferLimits(max_bytes=5000)).feed(
            chunks_of(ids, bytes(6000))[0], topic_sender="agent", kinds=UPDATE
        )
    with pytest.raises(TransferRejected, match="too-many-chunks"):
        make(ids, TransferLimits(max_chunks=3)).feed(chunks_of(ids, bytes(4000))[0], topic_sender="agent", kinds=UPDATE)


def test_partial_transfers_per_sender_are_capped_and_time_out(ids):
    now = [0.0]
    r = make(ids, TransferLimits(max_partial_per_sender=2, partial_timeout_s=10), clock=lambda: now[0])
    for _ in range(2):
        assert r.feed(chunks_of(ids, bytes(3000))[0], topic_sender="agent", kinds=UPDATE) is None
    with pytest.raises(TransferRejected, match="too-many-partial-transfers"):
        r.feed(chunks_of(ids, bytes(3000))[0], topic_sender="agent", kinds=UPDATE)
    assert r.pending_bytes() == 6000
    now[0] = 11.0
    expired = r.expire()
    assert [e.reason for e in expired] == ["transfer-timeout"] * 2 and r.pending_bytes() == 0


def test_topic_must_match_the_signed_sender_and_kind(ids):
    chunk = chunks_of(ids, b"x" * 10)[0]
    with pytest.raises(TransferRejected, match="sender-mismatch"):
        make(ids).feed(chunk, topic_sender="someone-else", kinds=UPDATE)
    with pytest.raises(TransferRejected, match="wrong-kind"):
        make(ids).feed(chunk, topic_sender="agent", kinds=frozenset({"model"}))


def test_a_corrupt_chunk_drops_the_partial_transfer(ids):
    chunks = chunks_of(ids, os.urandom(3000))
    r = make(ids)
    r.feed(chunks[0], topic_sender="agent", kinds=UPDATE)
    bad = chunks[1][:-1] + bytes([chunks[1][-1] ^ 1])
    with pytest.raises(TransferRejected, match="bad-chunk"):
        r.feed(bad, topic_sender="agent", kinds=UPDATE)
    assert r.pending_bytes() == 0


def test_replay_of_a_finished_transfer_is_rejected(ids):
    chunks = chunks_of(ids, b"y" * 100)
    r = make(ids)
    assert r.feed(chunks[0], topic_sender="agent", kinds=UPDATE) is not None
    with pytest.raises(TransferRejected, match="replay"):
        r.feed(chunks[0], topic_sender="agent", kinds=UPDATE)


def test_bad_limits_are_refused_with_the_key():
    with pytest.raises(ValueError, match="limits.max_chunks"):
        TransferLimits(max_chunks=0)
