"""Sealed, chunked, sender-authenticated transfers (the construction is in security/README.md).

A transfer (a model or a delta, up to hundreds of MB) becomes N chunk payloads of about 1 MiB. Each
payload carries the signed manifest, so chunks can be checked and decrypted in any order:

    b"SKF" | u8 version | u32 manifest length | manifest | Ed25519 signature (64) | u32 index | AES-256-GCM

The manifest binds federation, kind, round, sender, recipient, transfer id, time, sizes and the
SHA-256 of the whole plaintext, and is signed by the sender. The chunk key is derived per transfer
with HKDF-SHA256 from an ephemeral-static X25519 secret (sealed to one recipient) or from the
federation's group key (the broadcast model); the chunk index is the GCM nonce and, with the manifest
digest, the associated data. ``InvalidEnvelope`` is the only exception ``Opener`` raises.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from security.keys import RAW, GroupKey, Identity, Keyring, PublicIdentity
from security.replay import ReplayGuard

VERSION = 1
MAGIC = b"SKF"
SIGN_CONTEXT = b"skyfed/manifest/v1"
KEY_CONTEXT = b"skyfed/chunk-key/v1"
MIN_CHUNK, MAX_CHUNK = 1 << 10, 16 << 20
NO_DIGEST = bytes(32)
_PREFIX = struct.Struct(">3sBI")
_FIXED = struct.Struct(">BIdQIIQ")  # version, round, created_at, size, chunk_size, n_chunks, reserved
TAG = 16
SIG = 64


class InvalidEnvelope(Exception):
    """Any bad chunk; ``reason`` is short and stable (see security/README.md). ``signed``: the manifest, where
    the refusal is one its signer alone can cause (``from-the-future``: nobody else can sign a later time)."""

    def __init__(self, reason: str, signed: Manifest | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.signed = signed


def _pack_str(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > 64:
        raise ValueError(f"{value!r} is longer than 64 bytes")
    return bytes([len(raw)]) + raw


@dataclass(frozen=True)
class Manifest:
    federation: str
    kind: str
    round: int
    sender: str
    recipient: str
    transfer_id: bytes
    created_at: float
    size: int
    chunk_size: int
    n_chunks: int
    sha256: bytes  # of the whole plaintext; all zero when sealed to one recipient (see needs_digest)
    key_id: str = ""
    eph_pub: bytes = b""
    version: int = VERSION

    def to_bytes(self) -> bytes:
        fixed = _FIXED.pack(self.version, self.round, self.created_at, self.size, self.chunk_size, self.n_chunks, 0)
        strings = b"".join(_pack_str(s) for s in (self.federation, self.kind, self.sender, self.recipient, self.key_id))
        return fixed + strings + self.transfer_id + self.sha256 + bytes([len(self.eph_pub)]) + self.eph_pub

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            version, rnd, created, size, chunk_size, n_chunks, _ = _FIXED.unpack_from(data, 0)
            pos, strings = _FIXED.size, []
            for _ in range(5):
                length = data[pos]
                strings.append(data[pos + 1 : pos + 1 + length].decode())
                pos += 1 + length
            transfer_id, digest = data[pos : pos + 16], data[pos + 16 : pos + 48]
            eph_len = data[pos + 48]
            eph_pub = data[pos + 49 : pos + 49 + eph_len]
            end = pos + 49 + eph_len
        except (struct.error, IndexError, UnicodeDecodeError):
            raise InvalidEnvelope("malformed") from None
        if end != len(data) or len(transfer_id) != 16 or len(digest) != 32 or eph_len not in (0, 32):
            raise InvalidEnvelope("malformed")
        manifest = cls(
            strings[0],
            strings[1],
            rnd,
            strings[2],
            strings[3],
            transfer_id,
            created,
            size,
            chunk_size,
            n_chunks,
            digest,
            strings[4],
            eph_pub,
            version,
        )
        if not (MIN_CHUNK <= chunk_size <= MAX_CHUNK) or n_chunks != max(1, math.ceil(size / chunk_size)):
            raise InvalidEnvelope("malformed")
        if not math.isfinite(created) or (manifest.needs_digest and manifest.sha256 == NO_DIGEST):
            raise InvalidEnvelope("malformed")
        return manifest

    @property
    def needs_digest(self) -> bool:
        """Group-sealed transfers carry the plaintext's SHA-256: every member knows the chunk key and could
        forge chunks, and AES-GCM tags are not collision resistant to a key holder. A transfer sealed to
        one recipient needs no digest: only sender and recipient can derive its key, each chunk is
        authenticated at its index, and the signed manifest fixes the size and chunk count, so the whole
        is authentic when every chunk is — hashing 12.8 MB twice would only add 14 ms per update."""
        return self.recipient == "*"


@dataclass(frozen=True)
class OpenedChunk:
    manifest: Manifest
    index: int
    plaintext: bytes


def _chunk_key(secret: bytes, manifest_bytes: bytes, transfer_id: bytes) -> AESGCM:
    info = KEY_CONTEXT + hashlib.sha256(manifest_bytes).digest()
    return AESGCM(HKDF(hashes.SHA256(), 32, salt=transfer_id, info=info).derive(secret))


def _nonce(index: int) -> bytes:
    return index.to_bytes(12, "big")


def _aad(manifest_digest: bytes, index: int) -> bytes:
    return manifest_digest + index.to_bytes(4, "big")


def seal(
    plaintext: bytes | bytearray | memoryview,
    *,
    sender: Identity,
    federation: str,
    kind: str,
    round: int,
    recipient: PublicIdentity | None = None,
    group_key: GroupKey | None = None,
    chunk_size: int = 1 << 20,
    now: float | None = None,
) -> tuple[Manifest, list[bytearray]]:
    """Encrypt and sign ``plaintext`` for one recipient or for the group; return the chunk payloads."""
    if (recipient is None) == (group_key is None):
        raise ValueError("seal needs exactly one of recipient= or group_key=")
    if not MIN_CHUNK <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be in [{MIN_CHUNK}, {MAX_CHUNK}], got {chunk_size}")
    view = memoryview(plaintext).cast("B")
    transfer_id = secrets.token_bytes(16)
    if recipient is not None:
        ephemeral = X25519PrivateKey.generate()
        secret = ephemeral.exchange(recipient.exchange_key)
        eph_pub, key_id, to = ephemeral.public_key().public_bytes(**RAW), "", recipient.name
    else:
        assert group_key is not None
        secret, eph_pub, key_id, to = group_key.key, b"", group_key.key_id, "*"
    manifest = Manifest(
        federation=federation,
        kind=kind,
        round=round,
        sender=sender.name,
        recipient=to,
        transfer_id=transfer_id,
        created_at=time.time() if now is None else now,
        size=len(view),
        chunk_size=chunk_size,
        n_chunks=max(1, math.ceil(len(view) / chunk_size)),
        sha256=hashlib.sha256(view).digest() if group_key is not None else NO_DIGEST,
        key_id=key_id,
        eph_pub=eph_pub,
    )
    manifest_bytes = manifest.to_bytes()
    digest = hashlib.sha256(manifest_bytes).digest()
    signature = sender.signing_key.sign(SIGN_CONTEXT + manifest_bytes)
    aead = _chunk_key(secret, manifest_bytes, transfer_id)
    head = _PREFIX.pack(MAGIC, VERSION, len(manifest_bytes)) + manifest_bytes + signature
    chunks = []
    for index in range(manifest.n_chunks):
        piece = view[index * chunk_size : (index + 1) * chunk_size]
        out = bytearray(len(head) + 4 + len(piece) + TAG)
        out[: len(head)] = head
        out[len(head) : len(head) + 4] = index.to_bytes(4, "big")
        aead.encrypt_into(_nonce(index), piece, _aad(digest, index), memoryview(out)[len(head) + 4 :])
        chunks.append(out)
    return manifest, chunks


@dataclass
class _Verified:
    manifest: Manifest
    digest: bytes
    aead: AESGCM


@dataclass
class Opener:
    """Verifies and decrypts chunks addressed to ``identity`` (or to the group) from enrolled senders."""

    identity: Identity
    federation: str
    senders: Keyring
    group_keys: Mapping[str, GroupKey] | Callable[[str], GroupKey | None] = field(default_factory=dict)
    max_age_s: float = 3600.0
    max_clock_skew_s: float = 300.0
    clock: Callable[[], float] = time.time
    cache_size: int = 256
    replay: ReplayGuard = field(init=False)
    _cache: OrderedDict[bytes, _Verified] = field(init=False, default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.replay = ReplayGuard(self.max_age_s, self.clock)

    def _split(self, payload: bytes) -> tuple[bytes, bytes, int, int]:
        if len(payload) < _PREFIX.size:
            raise InvalidEnvelope("malformed")
        magic, version, length = _PREFIX.unpack_from(payload, 0)
        if magic != MAGIC:
            raise InvalidEnvelope("malformed")
        if version != VERSION:
            raise InvalidEnvelope("unsupported-version")
        start = _PREFIX.size
        body_at = start + length + SIG + 4
        if len(payload) < body_at + TAG:
            raise InvalidEnvelope("malformed")
        manifest_bytes = bytes(payload[start : start + length])
        signature = bytes(payload[start + length : start + length + SIG])
        index = int.from_bytes(payload[start + length + SIG : body_at], "big")
        return manifest_bytes, signature, index, body_at

    def _group_key(self, key_id: str) -> GroupKey | None:
        if callable(self.group_keys):
            return self.group_keys(key_id)
        return self.group_keys.get(key_id)

    def _verify(self, manifest_bytes: bytes, signature: bytes) -> _Verified:
        digest = hashlib.sha256(manifest_bytes).digest()
        cached = self._cache.get(digest)
        if cached is None:
            manifest = Manifest.from_bytes(manifest_bytes)
            if manifest.federation != self.federation:
                raise InvalidEnvelope("wrong-federation")
            sender = self.senders.get(manifest.sender)
            if sender is None:
                raise InvalidEnvelope("unknown-sender")
            try:
                sender.verify_key.verify(signature, SIGN_CONTEXT + manifest_bytes)
            except InvalidSignature:
                raise InvalidEnvelope("bad-signature") from None
            if manifest.recipient == "*":
                group_key = self._group_key(manifest.key_id)
                if group_key is None:
                    raise InvalidEnvelope("unknown-key")
                secret = group_key.key
            elif manifest.recipient == self.identity.name and len(manifest.eph_pub) == 32:
                from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

                secret = self.identity.exchange_key.exchange(X25519PublicKey.from_public_bytes(manifest.eph_pub))
            else:
                raise InvalidEnvelope("wrong-recipient")
            cached = _Verified(manifest, digest, _chunk_key(secret, manifest_bytes, manifest.transfer_id))
            self._cache[digest] = cached
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(digest)
            if cached.manifest.sender not in self.senders:  # revoked since it was cached
                raise InvalidEnvelope("unknown-sender")
        manifest = cached.manifest
        now = self.clock()
        if manifest.created_at < now - self.max_age_s:
            raise InvalidEnvelope("expired")
        if manifest.created_at > now + self.max_clock_skew_s:
            raise InvalidEnvelope("from-the-future", manifest)
        if self.replay.seen(manifest.transfer_id):
            raise InvalidEnvelope("replay")
        return cached

    def open_chunk_into(self, payload: bytes, out_for: Callable[[Manifest, int], memoryview]) -> tuple[Manifest, int]:
        """Verify a chunk and decrypt it straight into ``out_for(manifest, index)`` (no intermediate copy).

        ``out_for`` is called after the manifest is verified (signature once per transfer, then cached) and
        the index checked, so a receiver can apply its own limits there before committing memory; it
        returns a buffer of exactly the chunk's plaintext length (the reassembly buffer, for instance).
        """
        manifest_bytes, signature, index, body_at = self._split(payload)
        verified = self._verify(manifest_bytes, signature)
        manifest = verified.manifest
        if index >= manifest.n_chunks:
            raise InvalidEnvelope("bad-chunk")
        out = out_for(manifest, index)
        if len(out) != len(payload) - body_at - TAG:
            raise InvalidEnvelope("bad-chunk")
        try:
            verified.aead.decrypt_into(_nonce(index), memoryview(payload)[body_at:], _aad(verified.digest, index), out)
        except InvalidTag:
            raise InvalidEnvelope("bad-chunk") from None
        return manifest, index

    def open_chunk(self, payload: bytes) -> OpenedChunk:
        """Verify and decrypt one chunk into a new buffer."""
        holder: list[bytearray] = []

        def fresh_buffer(manifest: Manifest, index: int) -> memoryview:
            holder.append(bytearray(chunk_length(manifest, index)))
            return memoryview(holder[0])

        manifest, index = self.open_chunk_into(payload, fresh_buffer)
        return OpenedChunk(manifest, index, bytes(holder[0]))


def chunk_length(manifest: Manifest, index: int) -> int:
    """Plaintext bytes in chunk ``index`` (the last one may be short)."""
    return min(manifest.chunk_size, manifest.size - index * manifest.chunk_size)
