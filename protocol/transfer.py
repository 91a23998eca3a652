"""Reassembly of chunked, sealed transfers, with hard limits (docs/architecture.md, round lifecycle step 3).

Chunks arrive in any order, possibly twice (MQTT QoS 1 redelivers), possibly never, possibly forged.
A chunk repeated while its transfer is incomplete is ignored; once a transfer is complete its id is
remembered and any later chunk of it is rejected as a replay. A chunk that fails to open is dropped on
its own: the signed manifest already names every chunk, so a forged chunk at some index (anyone can
copy a manifest off the broker) cannot void an honest transfer, whose genuine chunk still fills it.

A transfer's slot opens only for a chunk that authenticates: the first chunk of a new transfer is
decrypted aside and copied in once its tag checks, so tampered copies of genuine chunks (whose signed
manifests verify) open nothing. A new transfer supersedes the same sender's unfinished ones of the same
kind signed earlier (a re-published model, an update re-sent after a broken link): old chunks replayed
from the broker cannot hold slots a newer transfer needs. A partial transfer that received nothing for
``partial_timeout_s`` is freed. A receiver that knows whose transfers it expects (the server: the open
round's pending agents) passes ``admit``, asked before a new transfer opens; the chunks of a transfer it
refused are then dropped quietly (one refusal per transfer, not one per chunk), and ``drop_where`` frees
the transfers that can no longer be used (a closed round's).

Memory is bounded by what was *received*, not by what a manifest claims: a transfer's buffer is an
anonymous mapping that the kernel commits as chunks are decrypted into it, and every chunk is charged
against a per-sender and a global quota before it is written, for every commit unit it can touch that
was not charged yet (never more than the mapping can hold). The mapping asks for transparent huge
pages: a 12.8 MB update then costs 7 page faults instead of 3,125 (measured: 13 ms → 7 ms to
reassemble it), so the commit unit is the huge-page size. A
claimed size is also checked against ``max_bytes`` and ``max_chunks`` before anything is mapped.
Cryptography is ``security.envelope``'s job, MQTT the daemons'. This
module never raises anything but ``TransferRejected``.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from security.envelope import InvalidEnvelope, Manifest, Opener, chunk_length

log = logging.getLogger("skyfed.transfer")

MiB = 1 << 20
PAGE = mmap.PAGESIZE
MAX_REFUSED_REMEMBERED = 4096  # transfer ids whose later chunks are dropped without another refusal


def _huge_page_size() -> int:
    try:
        return int(open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read())
    except (OSError, ValueError):
        return PAGE


COMMIT_UNIT = max(PAGE, _huge_page_size())  # the most one fault can commit in an advised mapping


@dataclass(frozen=True)
class TransferLimits:
    """Hard limits on incoming transfers (config keys in ``[limits]`` of server.toml)."""

    max_bytes: int = 512 * MiB
    max_chunks: int = 1024
    max_partial_per_sender: int = 2
    max_pending_bytes_per_sender: int = 1024 * MiB
    max_pending_bytes: int = 1024 * MiB
    partial_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_chunks", "max_partial_per_sender"):
            if getattr(self, name) < 1:
                raise ValueError(f"limits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_pending_bytes_per_sender", "max_pending_bytes"):
            if getattr(self, name) < PAGE:
                raise ValueError(f"limits.{name} must be at least one page ({PAGE} bytes), got {getattr(self, name)}")
        if self.partial_timeout_s <= 0:
            raise ValueError(f"limits.partial_timeout_s must be > 0, got {self.partial_timeout_s}")


class TransferRejected(Exception):
    """A chunk or a whole transfer was refused; ``sender`` and a short ``reason`` say which and why.

    ``whole_round`` is set when a signed manifest was verified and its whole transfer is refused (too
    large, too many chunks, digest mismatch, signed at a time still ahead of the receiver's clock): the
    manifest's round, for which that sender sent nothing usable, so a server need not wait for it."""

    def __init__(self, sender: str, reason: str, whole_round: int | None = None) -> None:
        super().__init__(f"{sender}: {reason}")
        self.sender = sender
        self.reason = reason
        self.whole_round = whole_round


@dataclass(frozen=True)
class Completed:
    """A verified, complete transfer: the signed manifest and the plaintext (a view of a private mapping)."""

    manifest: Manifest
    data: memoryview
    wire_bytes: int


class _AlreadyHeld(Exception):
    """Raised inside decryption to skip a chunk this transfer already has."""


@dataclass
class _Partial:
    manifest: Manifest
    buffer: mmap.mmap
    missing: set[int]
    last_chunk_at: float  # the time-out counts from here: a slow link that still delivers keeps its transfer
    units: set[int] = field(default_factory=set)  # commit units already charged
    held: int = 0
    wire_bytes: int = 0

    def charge(self, start: int, length: int) -> tuple[int, list[int]]:
        """Bytes that writing ``[start, start + length)`` can newly commit, and the units they are.

        The mapping need not start on a unit boundary, so a range can touch one unit past its last
        relative one; and nothing commits beyond the mapping's own (page-rounded) size."""
        first, last = start // COMMIT_UNIT, (start + length - 1) // COMMIT_UNIT
        new = [u for u in range(first, last + 2) if u not in self.units]
        capacity = -(-len(self.buffer) // PAGE) * PAGE
        return min(len(new) * COMMIT_UNIT, capacity - self.held), new


@dataclass
class Reassembler:
    """Turns chunk payloads into ``Completed`` transfers for one receiving node."""

    opener: Opener
    limits: TransferLimits = field(default_factory=TransferLimits)
    clock: Callable[[], float] = time.monotonic
    _partials: dict[bytes, _Partial] = field(default_factory=dict)
    _held_by_sender: Counter[str] = field(default_factory=Counter)
    _refused: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # transfers ``admit`` turned away

    def feed(
        self,
        payload: bytes,
        *,
        topic_sender: str,
        kinds: frozenset[str],
        topic_round: int | None = None,
        admit: Callable[[Manifest], None] | None = None,
    ) -> Completed | None:
        """Add one chunk; return the transfer when it is complete, None while it is not.

        ``topic_sender`` is the id in the topic the chunk came on (the broker ACL vouches for it) and
        must match the signed sender; ``kinds`` are the manifest kinds this topic may carry; a topic that
        names a round or model version (``model/<version>/…``) must name the one the manifest signs.
        ``admit`` raises ``TransferRejected`` for a new transfer this receiver does not expect.
        """
        places: list[_Partial | bytearray] = []

        def slot(manifest: Manifest, index: int) -> memoryview:
            """Called by the opener once the manifest is verified: check, charge, then hand out the place."""
            if manifest.sender != topic_sender:
                raise TransferRejected(topic_sender, f"sender-mismatch: signed by {manifest.sender}")
            if manifest.kind not in kinds:
                raise TransferRejected(topic_sender, f"wrong-kind: {manifest.kind}")
            if topic_round is not None and manifest.round != topic_round:
                raise TransferRejected(
                    topic_sender, f"topic-mismatch: signed for {manifest.round}, sent on {topic_round}"
                )
            partial = self._partials.get(manifest.transfer_id)
            if partial is None:  # a new transfer: decrypted aside, opened only if this chunk authenticates
                if manifest.transfer_id in self._refused:
                    raise _AlreadyHeld  # refused once already: its other chunks are dropped quietly
                if admit is not None:
                    self._admit(admit, manifest)
                self._check_claim(manifest)
                aside = bytearray(chunk_length(manifest, index))
                places.append(aside)
                return memoryview(aside)
            if index not in partial.missing:
                raise _AlreadyHeld
            places.append(partial)
            return self._place(partial, index)  # stays charged even if the chunk fails: its pages may be written

        try:
            manifest, index = self.opener.open_chunk_into(payload, slot)
        except _AlreadyHeld:
            return None  # QoS 1 re-delivery of a chunk we already hold
        except InvalidEnvelope as exc:  # dropped on its own: the transfer stays open for the genuine chunk
            signed = exc.signed  # ... unless its sender signed it so: a clock ahead refuses all it sends
            whole = signed.round if signed is not None and signed.sender == topic_sender else None
            raise TransferRejected(topic_sender, exc.reason, whole) from None
        partial = places[0]
        if isinstance(partial, bytearray):
            partial = self._open(manifest, first_chunk=partial, index=index)
        partial.missing.discard(index)
        partial.wire_bytes += len(payload)
        partial.last_chunk_at = self.clock()
        if partial.missing:
            return None
        return self._finish(partial)

    def expire(self) -> list[TransferRejected]:
        """Free partial transfers idle longer than the time-out; return one rejection per freed transfer."""
        now = self.clock()
        timeout = self.limits.partial_timeout_s
        stale = [tid for tid, p in self._partials.items() if now - p.last_chunk_at > timeout]
        return [TransferRejected(self._drop(tid).manifest.sender, "transfer-timeout") for tid in stale]

    def drop_where(self, useless: Callable[[Manifest], bool]) -> int:
        """Free every unfinished transfer whose manifest is ``useless`` now; return how many were freed."""
        gone = [tid for tid, p in self._partials.items() if useless(p.manifest)]
        for tid in gone:
            self._drop(tid)
        return len(gone)

    def _admit(self, admit: Callable[[Manifest], None], manifest: Manifest) -> None:
        try:
            admit(manifest)
        except TransferRejected:
            self._refused[manifest.transfer_id] = None
            if len(self._refused) > MAX_REFUSED_REMEMBERED:
                self._refused.popitem(last=False)
            raise

    def pending_bytes(self) -> int:
        """Bytes that received chunks of unfinished transfers can hold (what the quotas count)."""
        return sum(self._held_by_sender.values())

    def _check_claim(self, manifest: Manifest) -> None:
        """What a manifest claims, checked before anything is decrypted or mapped."""
        sender = manifest.sender
        if manifest.size > self.limits.max_bytes:
            too_large = f"too-large: {manifest.size} > {self.limits.max_bytes} bytes"
            raise TransferRejected(sender, too_large, manifest.round)
        if manifest.n_chunks > self.limits.max_chunks:
            raise TransferRejected(
                sender, f"too-many-chunks: {manifest.n_chunks} > {self.limits.max_chunks}", manifest.round
            )

    def _open(self, manifest: Manifest, *, first_chunk: bytearray, index: int) -> _Partial:
        """A slot for a transfer whose first chunk authenticated: supersede, check the cap, map, copy it in."""
        sender = manifest.sender
        for tid, old in list(self._partials.items()):
            if old.manifest.sender == sender and old.manifest.kind == manifest.kind:
                if old.manifest.created_at < manifest.created_at:
                    self._drop(tid)
                    log.info("transfer superseded sender=%s kind=%s round=%d by=%d received=%d/%d", sender,
                             manifest.kind, old.manifest.round, manifest.round,
                             old.manifest.n_chunks - len(old.missing), old.manifest.n_chunks)  # fmt: skip
        open_from_sender = sum(p.manifest.sender == sender for p in self._partials.values())
        if open_from_sender >= self.limits.max_partial_per_sender:
            raise TransferRejected(sender, "too-many-partial-transfers")
        # Private anonymous memory: address space now, pages only as chunks are written into them.
        buffer = mmap.mmap(-1, max(manifest.size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if COMMIT_UNIT > PAGE and manifest.size >= COMMIT_UNIT:
            try:
                buffer.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):  # no THP in this kernel: plain pages, charged as units anyway
                pass
        partial = _Partial(manifest, buffer, set(range(manifest.n_chunks)), self.clock())
        self._partials[manifest.transfer_id] = partial
        try:
            self._place(partial, index)[:] = first_chunk
        except TransferRejected:
            self._drop(manifest.transfer_id)
            raise
        return partial

    def _place(self, partial: _Partial, index: int) -> memoryview:
        """Charge the quotas for chunk ``index`` of ``partial``, then return where its plaintext goes."""
        manifest = partial.manifest
        start, length = index * manifest.chunk_size, chunk_length(manifest, index)
        charge, units = partial.charge(start, length)
        self._reserve(manifest.sender, charge)
        partial.held += charge
        partial.units.update(units)
        return memoryview(partial.buffer)[start : start + length]

    def _reserve(self, sender: str, charge: int) -> None:
        if self._held_by_sender[sender] + charge > self.limits.max_pending_bytes_per_sender:
            raise TransferRejected(sender, "sender-quota-exceeded")
        if self.pending_bytes() + charge > self.limits.max_pending_bytes:
            raise TransferRejected(sender, "server-busy: pending-transfer memory is full")
        self._held_by_sender[sender] += charge

    def _release(self, sender: str, charge: int) -> None:
        self._held_by_sender[sender] -= charge
        if self._held_by_sender[sender] <= 0:
            del self._held_by_sender[sender]

    def _finish(self, partial: _Partial) -> Completed:
        manifest = partial.manifest
        self._drop(manifest.transfer_id)
        data = memoryview(partial.buffer)[: manifest.size]
        if manifest.needs_digest and hashlib.sha256(data).digest() != manifest.sha256:
            raise TransferRejected(manifest.sender, "digest-mismatch", manifest.round)
        self.opener.replay.remember(manifest)
        log.debug("transfer complete sender=%s kind=%s bytes=%d", manifest.sender, manifest.kind, manifest.size)
        return Completed(manifest=manifest, data=data, wire_bytes=partial.wire_bytes)

    def _drop(self, transfer_id: bytes) -> _Partial:
        partial = self._partials.pop(transfer_id)
        self._release(partial.manifest.sender, partial.held)
        return partial
