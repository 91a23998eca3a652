"""The agents' own models, for strategies that keep one per agent (model swapping, seed 004).

After a round, an agent's model is its start model plus its (clipped) delta, computed with
``models.weights.advanced`` exactly as the agent computes it, so both sides name it by the same
``fingerprint``. The ``ModelBank`` keeps each such model as one float32 safetensors file,
``<state_dir>/checkpoint/agents/r<round>/<agent>.safetensors``, written (fsync, atomic rename) before
the checkpoint that refers to it and read back memory-mapped. An ``Assignment`` says what an agent
starts its next round from: its own model (``local``: the agent has it on disk) or a model the server
seals to it (``inbox``: a swap partner's, or its own when the server clipped it, so it differs from
the agent's copy). Agents without an assignment start from the global model. Disk: one model per
agent that has an assignment, plus the models of the round being closed; files nothing refers to are
deleted at the next checkpoint.
"""

from __future__ import annotations

import mmap
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from common.files import atomic_write
from models.serialization import dumps, float32_region
from models.weights import TensorSpec, unflatten


@dataclass(frozen=True)
class Holding:
    """One kept model: ``owner``'s model after round ``round``, and its fingerprint."""

    round: int
    owner: str
    sha256: str


@dataclass(frozen=True)
class Assignment:
    """What one agent starts its next round from: ``source`` is ``local`` or ``inbox``."""

    source: str
    model: Holding

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Assignment:
        return cls(source=data["source"], model=Holding(**data["model"]))


def next_assignments(
    action: str,
    current: dict[str, Assignment],
    asked: list[str],
    kept: dict[str, Holding],
    exact: set[str],
    pairs: list[tuple[str, str]],
) -> dict[str, Assignment]:
    """Where every agent starts after a round that ``asked`` agents to train and ``kept`` the models of
    those whose update counted (none when the round was rolled back).

    ``average``: nobody keeps a model (all start from the new global one). ``local``: each agent in
    ``kept`` goes on from its own model (``local`` if it is ``exact``ly the agent's copy, else sent to its
    inbox). ``swap``: each pair exchanges models through the inbox; an unpaired agent goes on from its
    own. An agent asked but not kept (refused, late, excused) may have replaced its own copy by training
    anyway, so the model it keeps on the server is sent to its inbox; other agents keep their assignment.
    """
    if action == "average":
        return {}
    out = dict(current)
    for agent in asked:
        if agent not in kept and agent in out:
            out[agent] = Assignment("inbox", out[agent].model)
    for agent, holding in kept.items():
        out[agent] = Assignment("local" if agent in exact else "inbox", holding)
    for a, b in pairs:
        out[a], out[b] = Assignment("inbox", kept[b]), Assignment("inbox", kept[a])
    return out


class ModelBank:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, holding: Holding) -> Path:
        return self.directory / f"r{holding.round}" / f"{holding.owner}.safetensors"

    def put(self, holding: Holding, vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:
        atomic_write(self.path(holding), dumps(unflatten(vector, spec)), mode=0o600)

    def vector(self, holding: Holding) -> np.ndarray:
        """The kept model's float vector (global model layout), a read-only view of its file."""
        with open(self.path(holding), "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return float32_region(mapped)[0]

    def keep_only(self, holdings: set[Holding]) -> None:
        """Delete every kept model but ``holdings`` (and rounds' folders left empty)."""
        wanted = {self.path(h) for h in holdings}
        for folder in self.directory.iterdir():
            if not folder.is_dir():
                folder.unlink(missing_ok=True)
                continue
            for path in folder.iterdir():
                if path not in wanted:
                    path.unlink(missing_ok=True)
            if not any(folder.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)
