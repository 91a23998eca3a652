"""The models an agent may start a round from besides the global one (model swapping).

``local`` is this agent's own model after its last round, ``inbox`` the newest model the server
sealed to it alone (a swap partner's, say). Both are kept on disk (``agent.state.ProgressStore``), so a
restart needs neither again, and are found by ``models.weights.fingerprint``: the signed round task
names the exact model to start from, and where it came from does not matter.
"""

from __future__ import annotations

from agent.state import MODEL_SLOTS, ProgressStore
from models.weights import NamedArrays, fingerprint


class StartModels:
    def __init__(self, store: ProgressStore) -> None:
        self.store = store
        self._held: dict[str, tuple[str, NamedArrays]] = {}
        for slot in MODEL_SLOTS:
            arrays = store.load_model(slot)
            if arrays is not None:
                self._held[slot] = (fingerprint(arrays), arrays)

    def keep(self, slot: str, arrays: NamedArrays) -> str:
        """Store ``arrays`` durably in ``slot`` (replacing what it held); returns their fingerprint."""
        self.store.save_model(slot, arrays)
        self._held[slot] = (fingerprint(arrays), arrays)
        return self._held[slot][0]

    def find(self, sha256: str) -> NamedArrays | None:
        return next((arrays for sha, arrays in self._held.values() if sha == sha256), None)
