"""The models a participant may start a round from besides the global one (model swapping, FedAMN).

``local`` is this agent's own model after its last round, ``inbox`` the newest model the server
sealed to it alone (a swap partner's, say), ``peers`` the newest bundle of models it sealed to it for
the trainer to attend over (FedAMN), ``continued`` its model after its newest ``local`` round (model
swapping: trained on, not uploaded; the next task that ``continues`` trains on from it). All are kept
on disk (``participant.progress.ProgressStore``), so a restart needs none of them again, and the server's
are found by ``models.weights.fingerprint``: the signed round task names the exact model to start from, and where it
came from does not matter.
"""

from __future__ import annotations

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
                self._held[slot] = (fingerprint(loaded[0]), *loaded)

    def keep(self, slot: str, arrays: NamedArrays, round_number: int) -> str:
        """Store ``arrays`` (for round ``round_number``) durably in ``slot``, replacing what it held;
        returns their fingerprint."""
        self.store.save_model(slot, arrays, round_number)
        self._held[slot] = (fingerprint(arrays), arrays, round_number)
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
            arrays, _ = loads(data)
        except SerializationError as exc:
            raise StartModelRefused("malformed", str(exc)) from None
        return self.keep(slot, {name: a.copy() for name, a in arrays.items()}, round_number)

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
