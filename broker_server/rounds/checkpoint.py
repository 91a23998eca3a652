"""The server's durable state: written after every accepted update and every finished round.

Layout of ``<state_dir>/checkpoint/``: ``state.json`` (run id, next round, model version, the round in
progress, the replay guard) names the model file
``global-v<version>.safetensors`` and the cross-round strategy state ``strategy-v<version>.safetensors``;
``updates/round-<r>/`` holds the open round's accepted updates (``broker_server.rounds.update_store``),
``agents/`` the agents' own models that model-swapping strategies assign (``flcore.agent_models``), and
``assignments-<id>.json`` what each of those agents starts from and ``last_metrics-<id>.json`` the last round's
metrics, each written anew only when it changes (a round's end: rewriting thousands of agents' entries at every
accepted update cost more than the round's training, and the metrics were 104 kB of a 260 kB state at 1,000 agents).
``state.json`` is replaced last and atomically, so after a ``kill -9`` at any instant the server
resumes from a consistent state and no accepted update is lost. Files no longer named are deleted, or released to
be written over by the next round's (``common.spare_files``).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from broker_server.rounds.state_text import StateText
from broker_server.rounds.update_store import UpdateStore
from common.files import atomic_write, read_json, write_json
from flcore.agent_models import Assignment, ModelBank
from flcore.rounds import RoundState
from flcore.strategies.base import NamedArrays
from models.serialization import load_file, save_file

log = logging.getLogger("skyfed.server")

STATE_FILE = "state.json"
FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint this version cannot resume from; the message says what to do."""


def best_name(version: int) -> str:
    """The file of the best-evaluated global model (``flcore.election``)."""
    return f"best-v{version}.safetensors"


def new_run_id() -> str:
    """Names one server run (a fresh state directory); agents order tasks within a run by round."""
    return secrets.token_hex(6)


def model_evaluation(directory: Path) -> dict:
    """The evaluation of the global model in force, as the checkpoint in ``directory`` says ({}: none yet)."""
    state_path = directory / STATE_FILE
    state = read_json(state_path) if state_path.exists() else {}
    return (state.get("model_eval") or {}) if isinstance(state, dict) else {}


@dataclass(frozen=True)
class Checkpoint:
    run_id: str
    next_round: int
    model_version: int
    global_arrays: NamedArrays
    round_state: RoundState | None = None
    strategy_state: NamedArrays = field(default_factory=dict)
    last_metrics: dict | None = None
    replay: list[list] = field(default_factory=list)
    health: dict = field(default_factory=dict)  # broker_server.rounds.health.HealthBook.to_dict()
    pace: dict = field(default_factory=dict)  # broker_server.rounds.pace.PaceBook.to_dict()
    privacy: dict = field(default_factory=dict)  # broker_server.privacy.accountant.PrivacyLedger.to_dict()
    assignments: dict = field(default_factory=dict)  # agent -> flcore.agent_models.Assignment.to_dict()
    best: dict = field(default_factory=dict)  # the best-evaluated version so far (flcore.election)
    model_eval: dict | None = None  # the evaluation of the global model in force (None: from before it was kept)
    changes: list = field(default_factory=list)  # the last committed steps' norms (flcore.change_bound)
    fallback: dict = field(default_factory=dict)  # the version before the one in force (broker_server.rounds.fallback)
    late: list = field(default_factory=list)  # closed rounds, for their late updates (rounds.accept.LateWindow)


class CheckpointStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.updates = UpdateStore(directory / "updates")
        self.agents = ModelBank(directory / "agents")
        self._named: tuple[str | None, str | None] = (None, None)  # model and strategy file state.json names
        self._side: dict[str, tuple[object, str]] = {}  # kind -> the value last written to its own file, and the file
        self._text = StateText()  # state.json's growing parts, encoded once

    def save(self, checkpoint: Checkpoint) -> None:
        """Write the files ``state.json`` names, then it. A model file it does not name yet is always written
        anew: one left by a save that failed before ``state.json`` may hold another candidate model."""
        version = checkpoint.model_version
        model_file = f"global-v{version}.safetensors"
        if model_file != self._named[0]:
            save_file(self.directory / model_file, checkpoint.global_arrays)
        strategy_file = f"strategy-v{version}.safetensors" if checkpoint.strategy_state else None
        if strategy_file and strategy_file != self._named[1]:
            save_file(self.directory / strategy_file, checkpoint.strategy_state)
        assignments_file = self._side_file("assignments", checkpoint.assignments)
        metrics_file = self._side_file("last_metrics", checkpoint.last_metrics)
        state = {
            "format": FORMAT,
            "run_id": checkpoint.run_id,
            "next_round": checkpoint.next_round,
            "model_version": version,
            "model_file": model_file,
            "strategy_file": strategy_file,
            "last_metrics_file": metrics_file,
            "health": checkpoint.health,
            "pace": checkpoint.pace,
            "privacy": checkpoint.privacy,
            "assignments_file": assignments_file,
            "best": checkpoint.best,
            "model_eval": checkpoint.model_eval,
            "changes": checkpoint.changes,
            "fallback": checkpoint.fallback,
            "late": checkpoint.late,
        }
        atomic_write(self.directory / STATE_FILE, self._text.encode(state, checkpoint.round_state, checkpoint.replay))
        self._named = (model_file, strategy_file)
        try:  # committed: a file left behind is deleted next time, and must not make the caller undo the save
            self._delete_unnamed(checkpoint, model_file, strategy_file)
        except OSError as exc:
            log.warning("checkpoint written, but files it no longer names were not deleted: %s", exc)

    def _side_file(self, kind: str, value: object) -> str:
        """``value`` in its own file, ``<kind>-<id>.json``, written anew only when it is not the object last
        written there: ``EngineState`` hands the same table while it is unchanged (the assignments and the last
        round's metrics change when a round closes), so it is not encoded again at every accepted update."""
        last, name = self._side.get(kind, (None, ""))
        if value is not last or not name:
            name = f"{kind}-{secrets.token_hex(6)}.json"
            write_json(self.directory / name, value)
            self._side[kind] = (value, name)
        return name

    def _delete_unnamed(self, checkpoint: Checkpoint, model_file: str, strategy_file: str | None) -> None:
        rs = checkpoint.round_state
        best_file = best_name(checkpoint.best["version"]) if "version" in checkpoint.best else None
        fallback = checkpoint.fallback.get("version")
        late = {f"global-v{w['version']}.safetensors" for w in checkpoint.late if isinstance(w, dict) and w.get("owed")}
        keep = late | {
            STATE_FILE,
            model_file,
            strategy_file,
            best_file,
            f"global-v{fallback}.safetensors" if fallback else None,
            self.updates.directory.name,
            self.agents.directory.name,
            *(name for _, name in self._side.values()),
        }
        for path in self.directory.iterdir():
            if path.name not in keep and not path.name.startswith("."):
                path.unlink(missing_ok=True)
        self.updates.keep_only(rs.round if rs is not None else None)
        if rs is not None:  # assignments move on only when a round closes: its commit's save cleans the bank
            return  # (each of thousands of agents' assignments read at every accepted update costs O(agents))
        assignments = [Assignment.from_dict(a) for a in checkpoint.assignments.values()]
        self.agents.keep_only(set().union(*(a.holdings() for a in assignments)))

    def load(self) -> Checkpoint | None:
        state_path = self.directory / STATE_FILE
        if not state_path.exists():
            return None
        state = read_json(state_path)
        found = state.get("format", 1) if isinstance(state, dict) else "?"
        if found != FORMAT:
            raise CheckpointError(
                f"{state_path} was written by another SkyFed version (format {found}, this one reads {FORMAT}); "
                f"move {self.directory} aside to start a new run"
            )
        global_arrays, _ = load_file(self.directory / state["model_file"])
        self._named = (state["model_file"], state["strategy_file"])
        strategy_state = load_file(self.directory / state["strategy_file"])[0] if state["strategy_file"] else {}
        rs = state["round_state"]
        return Checkpoint(
            run_id=state["run_id"],
            next_round=state["next_round"],
            model_version=state["model_version"],
            global_arrays=global_arrays,
            round_state=RoundState.from_dict(rs) if rs is not None else None,
            strategy_state=strategy_state,
            last_metrics=self._load_side(state, "last_metrics", None),
            replay=state["replay"],
            health=state.get("health", {}),
            pace=state.get("pace", {}),
            privacy=state.get("privacy", {}),
            assignments=self._load_side(state, "assignments", {}),
            best=state.get("best", {}),
            model_eval=state.get("model_eval"),
            changes=state.get("changes") or [],
            fallback=state.get("fallback") or {},
            late=state.get("late") or [],
        )

    def _load_side(self, state: dict, kind: str, default: object) -> object:  # noqa: ANN401 - a JSON value
        """The ``kind`` value ``state`` names (a checkpoint from before ``<kind>_file`` holds it itself)."""
        name = state.get(f"{kind}_file")
        if not name:
            return state.get(kind, default)
        value = read_json(self.directory / name)
        self._side[kind] = (value, name)
        return value

    def load_version(self, version: int) -> NamedArrays | None:
        """The global model of ``version`` while its checkpoint file is kept (the fallback, a late window's), else
        None."""
        path = self.directory / f"global-v{version}.safetensors"
        return load_file(path)[0] if path.exists() else None

    def save_best(self, version: int, arrays: NamedArrays) -> None:
        save_file(self.directory / best_name(version), arrays)

    def load_best(self, version: int) -> NamedArrays:
        return load_file(self.directory / best_name(version))[0]
