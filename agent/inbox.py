"""What the server sends one agent, opened and kept: group keys, global models and start models.

Chunks arrive on the agent's inbox topic (group keys sealed to it, start models) and on the retained
model topics (the global model, sealed with the group key); ``protocol.transfer.Reassembler`` checks
and reassembles them, and frees a partial transfer that stopped arriving (``expire``, on every tick).
Only the newest global model is kept (or the one the current task names: a reset server starts again
at 1), the last ``GROUP_KEYS_KEPT`` group keys, and start models by fingerprint
(``participant.start_models``) until a task names one.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

from models.serialization import SerializationError, loads
from models.weights import NamedArrays, float_part
from participant.start_models import StartModelRefused, StartModels
from participant.trainer import PeerContext
from protocol.messages import AgentStart, RoundTask
from protocol.transfer import Completed, Reassembler, TransferLimits, TransferRejected
from security.envelope import Opener
from security.keys import GroupKey, Identity, Keyring, PublicIdentity

GROUP_KEYS_KEPT = 3  # after a rotation the previous key still opens the model until its re-publication
MODEL_LIMITS = TransferLimits(
    max_bytes=1 << 30, max_partial_per_sender=4, max_pending_bytes_per_sender=2 << 30, max_pending_bytes=2 << 30
)
log = logging.getLogger("skyfed.agent")
Warn = Callable[..., None]  # the daemon's throttled warning: (key, message, *args)


class ServerInbox:
    def __init__(
        self, identity: Identity, server: PublicIdentity, federation: str, start_models: StartModels, warn: Warn
    ) -> None:
        self.server = server
        self.group_keys: dict[str, GroupKey] = {}
        opener = Opener(identity=identity, federation=federation, senders=Keyring([server]), group_keys=self.group_keys)
        self.reassembler = Reassembler(opener, MODEL_LIMITS)
        self.models: dict[int, NamedArrays] = {}
        self.model_sha256 = ""
        self.start_models = start_models
        self.key_mismatch = False  # a group key arrived sealed to a key this agent no longer has
        self.warn = warn

    def feed(self, payload: bytes, kinds: frozenset[str], topic_round: int | None, task: RoundTask | None) -> str:
        """One chunk; the kind of transfer it completed (``groupkey``, ``start``, ``peers``, ``model``),
        ``groupkey-held`` for the group key it already uses (a resend), ``key-mismatch`` for a group key sealed
        to a key this agent no longer has, else ``""``."""
        try:
            completed = self.reassembler.feed(payload, topic_sender=self.server.name, kinds=kinds,
                                              topic_round=topic_round)  # fmt: skip
        except TransferRejected as exc:
            if "groupkey" in kinds and exc.reason == "bad-chunk":
                self.key_mismatch = True
                return "key-mismatch"
            self.warn(f"transfer-{exc.reason}", "transfer rejected kind=%s reason=%s", "/".join(kinds), exc.reason)
            return ""
        if completed is None:
            return ""
        kind = completed.manifest.kind
        if kind == "groupkey":
            return "groupkey" if self._on_group_key(completed) else "groupkey-held"
        if kind in ("start", "peers"):
            self._on_start_model(completed, task)
        else:
            self._on_model(completed, task)
        return kind

    def expire(self) -> None:
        """Free partial transfers that stopped arriving (a lost chunk, a broker restart, old chunks replayed):
        each holds one of the few slots every later model needs."""
        for rejection in self.reassembler.expire():
            self.warn("transfer-timeout", "transfer expired reason=%s", rejection.reason)

    def _on_group_key(self, completed: Completed) -> bool:
        """Keep the key as the newest; False when it already was (nothing changes)."""
        key = GroupKey.from_bytes(bytes(completed.data))
        self.key_mismatch = False
        if next(reversed(self.group_keys), None) == key.key_id:
            log.info("group key received again key_id=%s", key.key_id)
            return False
        self.group_keys.pop(key.key_id, None)
        self.group_keys[key.key_id] = key  # the newest last: the status reports it
        while len(self.group_keys) > GROUP_KEYS_KEPT:
            del self.group_keys[next(iter(self.group_keys))]
        log.info("group key received key_id=%s", key.key_id)
        return True

    def _on_model(self, completed: Completed, task: RoundTask | None) -> None:
        """Keep the newest model, or the one the current task names (a reset server starts again at 1)."""
        version = completed.manifest.round
        wanted = task.model_version if task is not None else None
        if version < max(self.models, default=0) and version != wanted:
            self.warn("model-older", "model ignored version=%d reason=older-than-held", version)
            return
        try:
            arrays, _ = loads(completed.data)
        except SerializationError as exc:
            log.warning("model rejected version=%d reason=%s", version, exc)
            return
        self.models = {version: arrays}  # only the newest version is ever needed
        manifest = completed.manifest  # sealed to this agent alone (resent to its inbox): no digest, so hash it
        digest = manifest.sha256 if manifest.needs_digest else hashlib.sha256(completed.data).digest()
        self.model_sha256 = digest.hex()
        log.info("model received version=%d bytes=%d", version, completed.manifest.size)

    def _on_start_model(self, completed: Completed, task: RoundTask | None) -> None:
        """A model (or FedAMN's bundle of models) sealed to this agent alone, kept until a task names it."""
        current, kind = task.round if task is not None else 0, completed.manifest.kind
        slot = "peers" if kind == "peers" else "inbox"
        try:
            sha256 = self.start_models.receive(completed.data, completed.manifest.round, current, slot)
        except StartModelRefused as exc:
            round_number = completed.manifest.round
            self.warn(f"{kind}-{exc.reason}", "%s model ignored round=%d reason=%s", kind, round_number, exc)
            return
        log.info("%s model received round=%d sha256=%s", kind, completed.manifest.round, sha256[:12])

    def start_model(self, task: RoundTask, start: AgentStart) -> NamedArrays | None:
        """The model this round starts from, if this agent has it (the global one, or by fingerprint)."""
        if start.source == "global":
            return self._global_model(task)
        return self.start_models.find(start.sha256)

    def peer_context(self, task: RoundTask, start: AgentStart) -> PeerContext | None:
        """FedAMN's models beside the start model (its cluster mates', and the global one), once both are here."""
        peers, global_model = self.start_models.find(start.peers_sha256), self._global_model(task)
        return None if peers is None or global_model is None else PeerContext(peers, float_part(global_model))

    def _global_model(self, task: RoundTask) -> NamedArrays | None:
        arrays = self.models.get(task.model_version)
        return arrays if arrays is not None and self.model_sha256 == task.model_sha256 else None
