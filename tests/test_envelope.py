"""Sealed chunked envelopes: round trips, and every tampering or misdirection is refused."""

import hashlib
import os
import random

import pytest

from security.envelope import InvalidEnvelope, Manifest, Opener, seal
from security.keys import GroupKey, Identity, Keyring

NOW = 1_800_000_000.0


def open_all(opener: Opener, payloads: list[bytes]) -> tuple[Manifest, bytes]:
    """Open a complete set of chunks (any order), check the whole-transfer SHA-256, remember it."""
    opened = [opener.open_chunk(p) for p in payloads]
    manifest = opened[0].manifest
    by_index = {c.index: c.plaintext for c in opened if c.manifest == manifest}
    if len(by_index) != manifest.n_chunks:
        raise InvalidEnvelope("malformed")
    data = b"".join(by_index[i] for i in range(manifest.n_chunks))
    if manifest.needs_digest and hashlib.sha256(data).digest() != manifest.sha256:
        raise InvalidEnvelope("bad-chunk")
    opener.replay.remember(manifest)
    return manifest, data


@pytest.fixture(scope="module")
def ids():
    return {name: Identity.generate(name) for name in ("server", "agent", "other")}


def opener_for(ids, me="server", senders=("agent",), clock=NOW, **kwargs):
    return Opener(
        identity=ids[me],
        federation="fed",
        senders=Keyring([ids[s].public for s in senders]),
        clock=lambda: clock,
        **kwargs,
    )


def sealed(ids, data, **kwargs):
    args = dict(
        sender=ids["agent"],
        federation="fed",
        kind="update",
        round=3,
        recipient=ids["server"].public,
        chunk_size=1024,
        now=NOW,
    )
    return seal(data, **{**args, **kwargs})


@pytest.mark.parametrize("size", [0, 1, 1024, 3 * 1024, 5000])
def test_round_trip_in_any_order(ids, size):
    data = os.urandom(size)
    manifest, chunks = sealed(ids, data)
    assert len(chunks) == max(1, -(-size // 1024))
    random.Random(size).shuffle(chunks)
    opened, plain = open_all(opener_for(ids), chunks)
    assert plain == data and opened == manifest and opened.round == 3 and opened.kind == "update"


def test_group_sealed_model_opens_with_the_group_key_only(ids):
    key = GroupKey.generate()
    data = os.urandom(4000)
    _, chunks = sealed(ids, data, sender=ids["server"], recipient=None, group_key=key, kind="model")
    agent_side = opener_for(ids, me="agent", senders=("server",), group_keys={key.key_id: key})
    assert open_all(agent_side, chunks)[1] == data
    with pytest.raises(InvalidEnvelope, match="unknown-key"):
        opener_for(ids, me="agent", senders=("server",)).open_chunk(chunks[0])


def test_plaintext_never_appears_in_the_payloads(ids):
    data = b"secret weights " * 500
    _, chunks = sealed(ids, data)
    assert not any(b"secret weights" in c for c in chunks)


def _tamper(payload: bytes, position: int) -> bytes:
    return payload[:position] + bytes([payload[position] ^ 0x01]) + payload[position + 1 :]


def test_flipped_ciphertext_bit_is_a_bad_chunk(ids):
    _, chunks = sealed(ids, os.urandom(2000))
    with pytest.raises(InvalidEnvelope, match="bad-chunk"):
        opener_for(ids).open_chunk(_tamper(chunks[0], len(chunks[0]) - 40))


def test_flipped_manifest_or_signature_bit_fails_the_signature(ids):
    _, chunks = sealed(ids, os.urandom(2000))
    manifest_len = int.from_bytes(chunks[0][4:8], "big")
    for position in (8 + 5, 8 + manifest_len + 3):  # inside the manifest (round), inside the signature
        with pytest.raises(InvalidEnvelope, match="bad-signature|malformed"):
            opener_for(ids).open_chunk(_tamper(chunks[0], position))


def test_chunk_moved_to_another_index_or_transfer_fails(ids):
    _, chunks = sealed(ids, os.urandom(3000))
    manifest_len = int.from_bytes(chunks[0][4:8], "big")
    index_at = 8 + manifest_len + 64
    moved = chunks[0][:index_at] + (1).to_bytes(4, "big") + chunks[0][index_at + 4 :]
    with pytest.raises(InvalidEnvelope, match="bad-chunk"):
        opener_for(ids).open_chunk(moved)
    _, others = sealed(ids, os.urandom(3000))
    spliced = others[0][:index_at] + chunks[0][index_at:]
    with pytest.raises(InvalidEnvelope, match="bad-chunk"):
        opener_for(ids).open_chunk(spliced)


def test_wrong_federation_unknown_sender_and_wrong_recipient(ids):
    _, chunks = sealed(ids, b"x" * 10)
    with pytest.raises(InvalidEnvelope, match="wrong-federation"):
        Opener(identity=ids["server"], federation="elsewhere", senders=Keyring([ids["agent"].public])).open_chunk(
            chunks[0]
        )
    with pytest.raises(InvalidEnvelope, match="unknown-sender"):
        opener_for(ids, senders=("other",)).open_chunk(chunks[0])
    with pytest.raises(InvalidEnvelope, match="wrong-recipient"):
        opener_for(ids, me="other").open_chunk(chunks[0])


def test_forged_sender_with_the_right_name_but_another_key(ids):
    impostor = Identity.generate("agent")
    _, chunks = sealed(ids, b"x" * 10, sender=impostor)
    with pytest.raises(InvalidEnvelope, match="bad-signature"):
        opener_for(ids).open_chunk(chunks[0])


def test_age_window_refuses_expired_and_future_envelopes(ids):
    _, chunks = sealed(ids, b"x" * 10)
    with pytest.raises(InvalidEnvelope, match="expired"):
        opener_for(ids, clock=NOW + 3601).open_chunk(chunks[0])
    with pytest.raises(InvalidEnvelope, match="from-the-future"):
        opener_for(ids, clock=NOW - 301).open_chunk(chunks[0])


def test_replay_after_a_transfer_was_accepted(ids):
    _, chunks = sealed(ids, b"x" * 10)
    opener = opener_for(ids)
    open_all(opener, chunks)
    with pytest.raises(InvalidEnvelope, match="replay"):
        opener.open_chunk(chunks[0])


def test_group_member_can_forge_chunks_but_the_signed_digest_catches_it(ids):
    key = GroupKey.generate()
    data = os.urandom(2048)
    manifest, chunks = sealed(ids, data, sender=ids["server"], recipient=None, group_key=key, kind="model")
    # A member who knows the group key re-encrypts chunk 1 with other content under the same manifest.
    from security.envelope import _aad, _chunk_key, _nonce

    manifest_len = int.from_bytes(chunks[1][4:8], "big")
    manifest_bytes = chunks[1][8 : 8 + manifest_len]
    digest = hashlib.sha256(manifest_bytes).digest()
    forged_body = _chunk_key(key.key, manifest_bytes, manifest.transfer_id).encrypt(
        _nonce(1), os.urandom(1024), _aad(digest, 1)
    )
    forged = chunks[1][: 8 + manifest_len + 64 + 4] + forged_body
    opener = opener_for(ids, me="agent", senders=("server",), group_keys={key.key_id: key})
    assert opener.open_chunk(forged).index == 1  # the chunk itself decrypts...
    with pytest.raises(InvalidEnvelope):
        open_all(opener, [chunks[0], forged])  # ...but the whole transfer fails its signed SHA-256


@pytest.mark.parametrize(
    "payload", [b"", b"SKF", b"XYZ\x01" + bytes(200), b"SKF\x09" + bytes(200), b"SKF\x01\x00\x00\x00\x05" + bytes(100)]
)
def test_garbage_is_refused_as_malformed(ids, payload):
    with pytest.raises(InvalidEnvelope, match="malformed|unsupported-version"):
        opener_for(ids).open_chunk(payload)


def test_manifest_binary_encoding_round_trips_and_rejects_inconsistent_sizes(ids):
    manifest, _ = sealed(ids, os.urandom(5000))
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    bad = Manifest(**{**manifest.__dict__, "n_chunks": manifest.n_chunks + 1})
    with pytest.raises(InvalidEnvelope, match="malformed"):
        Manifest.from_bytes(bad.to_bytes())
