"""A participant's durable progress, so a restart neither skips nor repeats a round nor loses an update.

``state.json`` records the run it belongs to, the last round this participant finished training, and
the round and attempt whose update the broker last *acknowledged* (written only after the PUBACKs, so a
crash mid-send leaves the update marked unsent). The update itself is kept as
``update-r<round>.safetensors`` until a newer round replaces it. ``task.json`` is the newest signed
round task the participant accepted: after a restart a replayed older task is still recognised as older.
For strategies that keep each agent's model (model swapping), ``local.safetensors`` is this agent's
model after its last round and ``inbox.safetensors`` the newest model the server sealed to it (a swap
partner's): a round task names the one to start from by fingerprint, and both survive a restart.
``peers.safetensors`` is the newest bundle of models the server sealed to it for its trainer to attend
over (FedAMN), named by fingerprint the same way.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.files import atomic_write, read_json, write_json
from models.serialization import dumps, load_file
from models.weights import NamedArrays

MODEL_SLOTS = ("local", "inbox", "peers", "continued")
RESIDUAL_FILE = "residual.safetensors"  # in the state dir: what top-k has not sent yet (protocol.codecs)


@dataclass
class Progress:
    run_id: str = ""
    last_completed_round: int = 0
    sent_round: int = 0
    sent_attempt: int = 0
    continued_from: str = ""  # the start model (fingerprint named by the task) the ``continued`` slot trained on from


class ProgressStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "state.json"
        self.task_path = directory / "task.json"

    def load(self) -> Progress:
        if not self.path.exists():
            return Progress()
        known = {f.name for f in dataclasses.fields(Progress)}
        return Progress(**{k: v for k, v in read_json(self.path).items() if k in known})

    def save(self, progress: Progress) -> None:
        write_json(self.path, asdict(progress))

    def save_task(self, document: dict[str, Any]) -> None:
        write_json(self.task_path, document)

    def load_task(self) -> dict[str, Any] | None:
        return read_json(self.task_path) if self.task_path.exists() else None

    def update_path(self, round_number: int) -> Path:
        return self.directory / f"update-r{round_number}.safetensors"

    def store_update(self, round_number: int, data: bytes) -> None:
        """Keep this round's update (and only it) on disk before it is sent."""
        kept = self.update_path(round_number)
        atomic_write(kept, data, mode=0o600)
        for name in os.listdir(self.directory):  # one call: a Path.glob per round cost more than the write's Python
            if name.startswith("update-r") and name.endswith(".safetensors") and name != kept.name:
                (self.directory / name).unlink(missing_ok=True)

    def drop_update(self, round_number: int) -> None:
        self.update_path(round_number).unlink(missing_ok=True)

    def stored_update(self, round_number: int) -> bytes | None:
        path = self.update_path(round_number)
        return path.read_bytes() if path.exists() else None

    def save_model(self, slot: str, arrays: NamedArrays, round_number: int, name: str = "") -> None:
        """Keep a start model durably: ``local`` (this agent's after its round), ``inbox`` (the server's),
        ``peers`` (a bundle of models, FedAMN, with the ``name`` the server gave it) or ``continued`` (trained in
        local rounds, never uploaded)."""
        assert slot in MODEL_SLOTS
        metadata = {"round": str(round_number), **({"name": name} if name else {})}
        atomic_write(self.directory / f"{slot}.safetensors", dumps(arrays, metadata), mode=0o600)

    def drop_model(self, slot: str) -> None:
        assert slot in MODEL_SLOTS
        (self.directory / f"{slot}.safetensors").unlink(missing_ok=True)

    def load_model(self, slot: str) -> tuple[NamedArrays, int, str] | None:
        """The model in ``slot``, the round it was kept for and its name ("": none was given)."""
        path = self.directory / f"{slot}.safetensors"
        if not path.exists():
            return None
        arrays, metadata = load_file(path)
        return arrays, int(metadata.get("round", "0")), metadata.get("name", "")
