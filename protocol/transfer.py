"""Reassembly of chunked, sealed transfers, with hard limits (ARCHITECTURE.md, round lifecycle step 3).

Chunks arrive in any order, possibly twice (MQTT QoS 1 redelivers), possibly never. A chunk repeated
while its transfer is incomplete is ignored; once a transfer is complete its id is remembered and any
later chunk of it is rejected as a replay (a redelivery then is indistinguishable from one, and harmless
either way). This module keeps the bookkeeping: one preallocated buffer per transfer that chunks are
decrypted straight into, the set of missing chunks, the whole-transfer SHA-256 check where the envelope
calls for one, and the limits that keep a flood from exhausting memory: maximum transfer size and chunk
count (checked on the signed manifest before any allocation), maximum concurrent partial transfers per
sender, and a time-out that frees transfers that never finish. Cryptography is ``security.envelope``'s
job; MQTT is the daemons'. This module never raises anything but ``TransferRejected``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from security.envelope import InvalidEnvelope, Manifest, Opener, chunk_length

log = logging.getLogger("skyfed.transfer")

MiB = 1 << 20


@dataclass(frozen=True)
class TransferLimits:
    """Hard limits on incoming transfers; every one is checked before memory is committed."""

    max_bytes: int = 512 * MiB
    max_chunks: int = 1024
    max_partial_per_sender: int = 2
    partial_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_chunks", "max_partial_per_sender"):
            if getattr(self, name) < 1:
                raise ValueError(f"limits.{name} must be >= 1, got {getattr(self, name)}")
        if self.partial_timeout_s <= 0:
            raise ValueError(f"limits.partial_timeout_s must be > 0, got {self.partial_timeout_s}")


class TransferRejected(Exception):
    """A chunk or a whole transfer was refused; ``sender`` and a short ``reason`` say which and why."""

    def __init__(self, sender: str, reason: str) -> None:
        super().__init__(f"{sender}: {reason}")
        self.sender = sender
        self.reason = reason


@dataclass(frozen=True)
class Completed:
    """A verified, complete transfer: the signed manifest and the plaintext."""

    manifest: Manifest
    data: bytearray
    wire_bytes: int


class _AlreadyHeld(Exception):
    """Raised inside decryption to skip a chunk this transfer already has."""


@dataclass
class _Partial:
    manifest: Manifest
    buffer: bytearray
    missing: set[int]
    started_at: float
    wire_bytes: int = 0


@dataclass
class Reassembler:
    """Turns chunk payloads into ``Completed`` transfers for one receiving node."""

    opener: Opener
    limits: TransferLimits = field(default_factory=TransferLimits)
    clock: Callable[[], float] = time.monotonic
    _partials: dict[bytes, _Partial] = field(default_factory=dict)

    def feed(self, payload: bytes, *, topic_sender: str, kinds: frozenset[str]) -> Completed | None:
        """Add one chunk; return the transfer when it is complete, None while it is not.

        ``topic_sender`` is the id in the topic the chunk came on (the broker ACL vouches for it) and
        must match the signed sender; ``kinds`` are the manifest kinds this topic may carry.
        """
        touched: list[_Partial] = []

        def slot(manifest: Manifest, index: int) -> memoryview:
            """Called by the opener once the manifest is verified: check, then hand out the chunk's place."""
            if manifest.sender != topic_sender:
                raise TransferRejected(topic_sender, f"sender-mismatch: signed by {manifest.sender}")
            if manifest.kind not in kinds:
                raise TransferRejected(topic_sender, f"wrong-kind: {manifest.kind}")
            partial = self._partials.get(manifest.transfer_id) or self._start(manifest)
            if index not in partial.missing:
                raise _AlreadyHeld
            touched.append(partial)
            start = index * manifest.chunk_size
            return memoryview(partial.buffer)[start : start + chunk_length(manifest, index)]

        try:
            _, index = self.opener.open_chunk_into(payload, slot)
        except _AlreadyHeld:
            return None  # QoS 1 re-delivery of a chunk we already hold
        except InvalidEnvelope as exc:
            if touched:  # the chunk failed decryption: the whole transfer is void
                self._drop(touched[0].manifest.transfer_id)
            raise TransferRejected(topic_sender, exc.reason) from None
        partial = touched[0]
        partial.missing.discard(index)
        partial.wire_bytes += len(payload)
        if partial.missing:
            return None
        return self._finish(partial)

    def expire(self) -> list[TransferRejected]:
        """Free partial transfers older than the time-out; return one rejection per freed transfer."""
        now = self.clock()
        stale = [tid for tid, p in self._partials.items() if now - p.started_at > self.limits.partial_timeout_s]
        return [TransferRejected(self._drop(tid).manifest.sender, "transfer-timeout") for tid in stale]

    def pending_bytes(self) -> int:
        return sum(len(p.buffer) for p in self._partials.values())

    def _start(self, manifest: Manifest) -> _Partial:
        sender = manifest.sender
        if manifest.size > self.limits.max_bytes:
            raise TransferRejected(sender, f"too-large: {manifest.size} > {self.limits.max_bytes} bytes")
        if manifest.n_chunks > self.limits.max_chunks:
            raise TransferRejected(sender, f"too-many-chunks: {manifest.n_chunks} > {self.limits.max_chunks}")
        open_from_sender = sum(p.manifest.sender == sender for p in self._partials.values())
        if open_from_sender >= self.limits.max_partial_per_sender:
            raise TransferRejected(sender, "too-many-partial-transfers")
        partial = _Partial(
            manifest=manifest,
            buffer=bytearray(manifest.size),
            missing=set(range(manifest.n_chunks)),
            started_at=self.clock(),
        )
        self._partials[manifest.transfer_id] = partial
        return partial

    def _finish(self, partial: _Partial) -> Completed:
        manifest = partial.manifest
        self._drop(manifest.transfer_id)
        if manifest.needs_digest and hashlib.sha256(partial.buffer).digest() != manifest.sha256:
            raise TransferRejected(manifest.sender, "digest-mismatch")
        self.opener.replay.remember(manifest)
        log.debug("transfer complete sender=%s kind=%s bytes=%d", manifest.sender, manifest.kind, manifest.size)
        return Completed(manifest=manifest, data=partial.buffer, wire_bytes=partial.wire_bytes)

    def _drop(self, transfer_id: bytes) -> _Partial:
        return self._partials.pop(transfer_id)
