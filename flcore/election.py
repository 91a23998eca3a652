"""SmartFed's best-model election (seed 001), ``[strategy] elect_best = true``.

Every published global model's evaluation on the server's data is compared with the best so far; the
best is kept as ``best-v<version>.safetensors`` next to the checkpoint (written before the checkpoint
that names it, so a crash never leaves an uncommitted model behind that name). When the run ends, that
version becomes the final global model — published again under a new version number if it was not the
last one — and ``server/status`` names it (``best``: version, round, accuracy (``map50`` for detectors),
published_as, and the ``onnx`` export report when the server exports ONNX).
"""

from __future__ import annotations

from typing import Protocol

from models.weights import NamedArrays
from protocol.messages import HEADLINE


class BestStore(Protocol):
    """Where the best model so far is kept (the server's checkpoint store; a peer's own state)."""

    def save_best(self, version: int, arrays: NamedArrays) -> None: ...

    def load_best(self, version: int) -> NamedArrays: ...


class BestModel:
    def __init__(self, store: BestStore, record: dict) -> None:
        self.store = store
        self.record = record  # {} until a model was evaluated; kept in the checkpoint

    @property
    def elected(self) -> bool:
        return bool(self.record.get("elected"))

    def note(self, version: int, round_number: int, evaluation: dict[str, float], arrays: NamedArrays) -> None:
        """A new global model ``version`` was committed with ``evaluation``: keep it if it is the best."""
        name = next((k for k in HEADLINE if evaluation.get(k) is not None), None)
        if name is not None and evaluation[name] > self.record.get(name, -1.0):
            self.store.save_best(version, arrays)
            self.record = {"version": version, "round": round_number, name: evaluation[name]}

    def elect(self, current_version: int) -> NamedArrays | None:
        """At the end of the run: the best model's arrays when they must be published again, else None."""
        self.record = {**self.record, "elected": True}
        if "version" not in self.record or self.record["version"] == current_version:
            return None
        return self.store.load_best(self.record["version"])

    def evaluation(self) -> dict[str, float]:
        """The best model's evaluation, as far as the record keeps it (its headline score)."""
        return {k: self.record[k] for k in HEADLINE if k in self.record}

    def published_as(self, version: int, onnx: dict | None = None) -> None:
        """The elected model went out again as ``version`` (``onnx``: the report of its ONNX export)."""
        self.record = {**self.record, "published_as": version, **({"onnx": onnx} if onnx is not None else {})}
