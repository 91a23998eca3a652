"""The server's durable state: written after every round and every accepted update, read at start.

Layout of ``<state_dir>/checkpoint/``: ``state.json`` (round, model version, the round in progress)
names the model file ``global-v<version>.safetensors`` and the strategy file
``strategy-r<round>-<n>.safetensors``; ``state.json`` is replaced last and atomically, so after a
``kill -9`` at any instant the server resumes from a consistent state and no accepted update is lost.
Files no longer named by ``state.json`` are deleted after it is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from broker_server.rounds import RoundState
from broker_server.strategies.base import NamedArrays
from models.serialization import load_file, save_file
from protocol.files import read_json, write_json

STATE_FILE = "state.json"


@dataclass(frozen=True)
class Checkpoint:
    next_round: int
    model_version: int
    global_arrays: NamedArrays
    round_state: RoundState | None = None
    strategy_state: NamedArrays | None = None


class CheckpointStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def save(self, checkpoint: Checkpoint) -> None:
        model_file = f"global-v{checkpoint.model_version}.safetensors"
        if not (self.directory / model_file).exists():
            save_file(self.directory / model_file, checkpoint.global_arrays)
        state: dict = {
            "next_round": checkpoint.next_round,
            "model_version": checkpoint.model_version,
            "model_file": model_file,
            "round_state": None,
            "strategy_file": None,
        }
        if checkpoint.round_state is not None and checkpoint.strategy_state is not None:
            rs = checkpoint.round_state
            strategy_file = f"strategy-r{rs.round}-a{rs.attempt}-n{len(rs.accepted)}.safetensors"
            save_file(self.directory / strategy_file, checkpoint.strategy_state)
            state["round_state"] = rs.to_dict()
            state["strategy_file"] = strategy_file
        write_json(self.directory / STATE_FILE, state)
        keep = {STATE_FILE, model_file, state["strategy_file"]}
        for path in self.directory.iterdir():
            if path.name not in keep and not path.name.startswith("."):
                path.unlink(missing_ok=True)

    def load(self) -> Checkpoint | None:
        state_path = self.directory / STATE_FILE
        if not state_path.exists():
            return None
        state = read_json(state_path)
        global_arrays, _ = load_file(self.directory / state["model_file"])
        round_state = strategy_state = None
        if state["round_state"] is not None:
            round_state = RoundState.from_dict(state["round_state"])
            strategy_state, _ = load_file(self.directory / state["strategy_file"])
        return Checkpoint(
            next_round=state["next_round"],
            model_version=state["model_version"],
            global_arrays=global_arrays,
            round_state=round_state,
            strategy_state=strategy_state,
        )
