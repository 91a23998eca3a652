"""The models a participant may start a round from besides the global one (model swapping, FedAMN).

``local`` is this agent's own model after its last round, ``inbox`` the newest model the server
sealed to it alone (a swap partner's, say), ``peers`` the newest bundle of models it sealed to it for
the trainer to attend over (FedAMN), ``continued`` its model after its newest ``local`` round (model
swapping: trained on, not uploaded; the next task that ``continues`` trains on from it). All are kept
on disk (``participant.progress.ProgressStore``), so a restart needs none of them again, and the server's
are found by ``models.weights.fingerprint``: the signed round task names the exact model to start from, and where it
came from does not matter. A ``peers`` bundle is found by the name the server sealed (and signed) into its
metadata (``flcore.agent_models.bundle_name``: hashing each recipient's bundle would cost the server a hash
of every model in it, for every recipient, every round).
"""

from __future__ import annotations

from flcore.agent_models import BUNDLE_NAME
from models.serialization import SerializationError, loads
from models.weights import NamedArrays, fingerprint
from participant.progress import MODEL_SLOTS, ProgressStore

SERVER_SLOTS = ("inbox", "peers")  # what the server sealed to this agent (``local`` is its own model)


class StartModelRefused(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class StartModels:
    def __init__(self, store: ProgressStore) -> None:
        self.store = store
        self._held: dict[str, tuple[str, NamedArrays, int]] = {}
        for slot in MODEL_SLOTS:
            loaded = store.load_model(slot)
            if loaded is not None:
                arrays, round_number, name = loaded
                self._held[slot] = (name or fingerprint(arrays), arrays, round_number)

    def keep(self, slot: str, arrays: NamedArrays, round_number: int, name: str = "") -> str:
        """Store ``arrays`` (for round ``round_number``) durably in ``slot``, replacing what it held; returns
        what finds them: ``name`` when the server gave one, else their fingerprint."""
        self.store.save_model(slot, arrays, round_number, name)
        self._held[slot] = (name or fingerprint(arrays), arrays, round_number)
        return self._held[slot][0]

    def receive(
        self, data: bytes | bytearray | memoryview, round_number: int, task_round: int, slot: str = "inbox"
    ) -> str:
        """Keep a model (or ``peers`` bundle) sealed for ``round_number`` in ``slot``; return its fingerprint.
        One for a round older than the current task's or than the one held is a replay, refused: it would
        evict the model a task names."""
        if round_number < max(task_round, self.round_of(slot)):
            raise StartModelRefused("stale", "older-than-held")
        try:
            arrays, metadata = loads(data)
        except SerializationError as exc:
            raise StartModelRefused("malformed", str(exc)) from None
        name = metadata.get(BUNDLE_NAME, "") if slot == "peers" else ""
        return self.keep(slot, {key: a.copy() for key, a in arrays.items()}, round_number, name)

    def new_run(self) -> None:
        """The server started a new run (its state was reset) at round 1: what it sealed to this agent before
        is of no use to it, and its rounds would refuse the new run's as replays."""
        for slot in (*SERVER_SLOTS, "continued"):
            self.store.drop_model(slot)
            self._held.pop(slot, None)

    def round_of(self, slot: str) -> int:
        """The round the model in ``slot`` was kept for (0 when empty)."""
        return self._held[slot][2] if slot in self._held else 0

    def continued(self) -> NamedArrays | None:
        """The model local rounds trained on (``continued`` slot), if any."""
        return self._held["continued"][1] if "continued" in self._held else None

    def find(self, sha256: str) -> NamedArrays | None:
        return next((arrays for sha, arrays, _ in self._held.values() if sha == sha256), None)
