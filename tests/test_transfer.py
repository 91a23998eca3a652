"""Chunk reassembly: any order, duplicates, whole-transfer integrity, and the hard limits."""

import gc
import os
import random
import time

import pytest

from protocol.transfer import COMMIT_UNIT, PAGE, Reassembler, TransferLimits, TransferRejected
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


def chunks_of(ids, data, chunk_size=1024, age_s=0.0):
    """Sealed chunks; ``age_s`` back-dates the signed manifest (an older transfer supersedes nothing)."""
    server, agent = ids
    return seal(data, sender=agent, federation="f", kind="update", round=1, recipient=server.public,
                chunk_size=chunk_size, now=time.time() - age_s)[1]  # fmt: skip


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
    for age_s in (1, 2):  # each older than the last: none supersedes another
        assert r.feed(chunks_of(ids, bytes(3000), age_s=age_s)[0], topic_sender="agent", kinds=UPDATE) is None
    with pytest.raises(TransferRejected, match="too-many-partial-transfers"):
        r.feed(chunks_of(ids, bytes(3000), age_s=3)[0], topic_sender="agent", kinds=UPDATE)
    assert r.pending_bytes() == 2 * PAGE  # one 1 KiB chunk each; a 3000-byte mapping commits at most a page
    now[0] = 11.0
    expired = r.expire()
    assert [e.reason for e in expired] == ["transfer-timeout"] * 2 and r.pending_bytes() == 0


def test_memory_follows_received_chunks_not_the_claimed_size(ids):
    """Two 64 MiB claims, first chunk only: the quota counts pages received, and RSS barely moves."""
    r = make(ids, TransferLimits(max_bytes=256 << 20, max_chunks=100_000))
    firsts = [chunks_of(ids, bytes(64 << 20), chunk_size=1 << 20, age_s=age)[0] for age in (1, 2)]
    gc.collect()
    rss_before = _rss_kib()  # after sealing: its garbage must not count against the receiver
    for first in firsts:
        r.feed(first, topic_sender="agent", kinds=UPDATE)
    assert r.pending_bytes() == 2 * 2 * COMMIT_UNIT  # the chunk's unit, and one more for alignment
    assert _rss_kib() - rss_before < 16 << 10  # far below the 128 MiB claimed


def test_the_charge_never_exceeds_what_the_mapping_can_hold(ids):
    data = os.urandom(5 * (1 << 20) + 123)
    chunks = chunks_of(ids, data, chunk_size=1 << 20)
    r = make(ids, TransferLimits(max_pending_bytes_per_sender=8 << 20))
    for chunk in chunks[-2::-2]:  # every other chunk, backwards: the least contiguous order
        r.feed(chunk, topic_sender="agent", kinds=UPDATE)
    assert len(data) < r.pending_bytes() <= -(-len(data) // PAGE) * PAGE


def test_per_sender_and_global_quotas_refuse_chunks_beyond_them(ids):
    limits = TransferLimits(max_partial_per_sender=8, max_pending_bytes_per_sender=PAGE + 1, max_pending_bytes=1 << 20)
    r = make(ids, limits)
    r.feed(chunks_of(ids, bytes(3000))[0], topic_sender="agent", kinds=UPDATE)  # 1 page
    with pytest.raises(TransferRejected, match="sender-quota-exceeded"):
        r.feed(chunks_of(ids, bytes(3000), age_s=1)[0], topic_sender="agent", kinds=UPDATE)
    shared = make(ids, TransferLimits(max_partial_per_sender=8, max_pending_bytes=PAGE + 1))
    shared.feed(chunks_of(ids, bytes(3000))[0], topic_sender="agent", kinds=UPDATE)
    with pytest.raises(TransferRejected, match="server-busy"):
        shared.feed(chunks_of(ids, bytes(3000), age_s=1)[0], topic_sender="agent", kinds=UPDATE)


def _rss_kib() -> int:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])


def test_topic_must_match_the_signed_sender_and_kind(ids):
    chunk = chunks_of(ids, b"x" * 10)[0]
    with pytest.raises(TransferRejected, match="sender-mismatch"):
        make(ids).feed(chunk, topic_sender="someone-else", kinds=UPDATE)
    with pytest.raises(TransferRejected, match="wrong-kind"):
        make(ids).feed(chunk, topic_sender="agent", kinds=frozenset({"model"}))


def test_a_forged_chunk_is_dropped_alone_and_the_genuine_one_still_completes_the_transfer(ids):
    data = os.urandom(3000)
    chunks = chunks_of(ids, data)
    r = make(ids)
    r.feed(chunks[0], topic_sender="agent", kinds=UPDATE)
    forged = chunks[1][:-1] + bytes([chunks[1][-1] ^ 1])  # someone copied the signed manifest
    with pytest.raises(TransferRejected, match="bad-chunk"):
        r.feed(forged, topic_sender="agent", kinds=UPDATE)
    assert r.pending_bytes() == PAGE  # all a 3000-byte mapping can commit, forged chunk or not
    assert r.feed(chunks[1], topic_sender="agent", kinds=UPDATE) is None
    done = r.feed(chunks[2], topic_sender="agent", kinds=UPDATE)
    assert done is not None and bytes(done.data) == data


def test_replay_of_a_finished_transfer_is_rejected(ids):
    chunks = chunks_of(ids, b"y" * 100)
    r = make(ids)
    assert r.feed(chunks[0], topic_sender="agent", kinds=UPDATE) is not None
    with pytest.raises(TransferRejected, match="replay"):
        r.feed(chunks[0], topic_sender="agent", kinds=UPDATE)


def test_bad_limits_are_refused_with_the_key():
    with pytest.raises(ValueError, match="limits.max_chunks"):
        TransferLimits(max_chunks=0)


def test_a_chunk_must_come_on_the_topic_its_manifest_names(ids):
    chunk = chunks_of(ids, b"m" * 100)[0]  # signed for round 1
    with pytest.raises(TransferRejected, match="topic-mismatch"):
        make(ids).feed(chunk, topic_sender="agent", kinds=UPDATE, topic_round=999)
    assert make(ids).feed(chunk, topic_sender="agent", kinds=UPDATE, topic_round=1) is not None


def test_the_time_out_counts_from_the_last_chunk_so_a_slow_link_keeps_its_transfer(ids):
    now = [0.0]
    r = make(ids, TransferLimits(partial_timeout_s=10), clock=lambda: now[0])
    slow, stalled = chunks_of(ids, bytes(5000), age_s=2), chunks_of(ids, bytes(5000), age_s=1)  # neither supersedes
    r.feed(stalled[0], topic_sender="agent", kinds=UPDATE)
    expired = []
    for chunk in slow[:-1]:  # one chunk every 8 s: 32 s in all, each gap under the time-out
        r.feed(chunk, topic_sender="agent", kinds=UPDATE)
        now[0] += 8.0
        expired += r.expire()
    assert [e.reason for e in expired] == ["transfer-timeout"]  # the stalled one only
    done = r.feed(slow[-1], topic_sender="agent", kinds=UPDATE)
    assert done is not None and r.pending_bytes() == 0


def test_a_newer_transfer_supersedes_an_older_unfinished_one_of_its_sender_and_kind(ids):
    """An update re-sent after a broken link (a fresh transfer) frees the copy whose chunks were lost; a
    tampered chunk of a newer transfer supersedes nothing."""
    lost, resent = chunks_of(ids, os.urandom(3000), age_s=5), chunks_of(ids, data := os.urandom(3000))
    r = make(ids, TransferLimits(max_partial_per_sender=1))
    r.feed(lost[0], topic_sender="agent", kinds=UPDATE)
    tampered = bytearray(resent[0])
    tampered[-20] ^= 1
    with pytest.raises(TransferRejected, match="bad-chunk"):
        r.feed(bytes(tampered), topic_sender="agent", kinds=UPDATE)
    assert r.pending_bytes() == PAGE  # the lost copy's first chunk, still held
    assert [r.feed(c, topic_sender="agent", kinds=UPDATE) for c in resent][-1].data == data
    assert r.pending_bytes() == 0
