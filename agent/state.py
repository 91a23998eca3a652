"""The agent's durable progress, so a restart neither skips nor repeats a round.

``state.json`` records the last round this agent finished training and the attempt under which it
last sent that round's update; the update itself is kept as ``update-r<round>.safetensors`` until a
newer round replaces it, so a server that lost it (restart, broker outage) can have it re-sent
without training again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from protocol.files import atomic_write, read_json, write_json


@dataclass
class AgentProgress:
    last_completed_round: int = 0
    last_sent_attempt: int = 0


class ProgressStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "state.json"

    def load(self) -> AgentProgress:
        if not self.path.exists():
            return AgentProgress()
        return AgentProgress(**read_json(self.path))

    def save(self, progress: AgentProgress) -> None:
        write_json(self.path, asdict(progress))

    def update_path(self, round_number: int) -> Path:
        return self.directory / f"update-r{round_number}.safetensors"

    def store_update(self, round_number: int, data: bytes) -> None:
        """Keep this round's update (and only it) on disk before it is sent."""
        atomic_write(self.update_path(round_number), data, mode=0o600)
        for old in self.directory.glob("update-r*.safetensors"):
            if old.name != self.update_path(round_number).name:
                old.unlink(missing_ok=True)

    def stored_update(self, round_number: int) -> bytes | None:
        path = self.update_path(round_number)
        return path.read_bytes() if path.exists() else None
