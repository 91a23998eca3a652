"""The server's checkpoint at one accepted update with 3,597 agents assigned models (a swap round open): the
time to turn the assignments into the checkpoint's table and to save it, mean of 100 (docs/results/swapping.md).

    PYTHONPATH=. python experiments/checkpoint_cost.py /dev/shm      # or a folder on disk, e.g. /tmp

Run at a commit from before assignments got their own file (e.g. 43e270b) it measures the old way: every
assignment turned into a dict and written into state.json at each update, and the model bank walked."""

from __future__ import annotations

import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from broker_server.rounds.checkpoint import Checkpoint, CheckpointStore
from broker_server.rounds.engine_state import EngineState
from flcore.agent_models import Assignment, Holding
from flcore.rounds import RoundState

AGENTS, SELECTED, SAVES = 3597, 540, 100


def main(folder: str) -> None:
    store = CheckpointStore(Path(tempfile.mkdtemp(dir=folder)) / "checkpoint")
    names = [f"agent-{i:04d}" for i in range(AGENTS)]
    assignments = {a: Assignment("inbox", Holding(3, names[(i + 1) % AGENTS], f"{i:064x}"))
                   for i, a in enumerate(names)}
    for holding in {x.model for x in assignments.values()}:
        store.agents.path(holding).parent.mkdir(parents=True, exist_ok=True)
        store.agents.path(holding).write_bytes(b"x")
    open_round = RoundState(round=4, attempt=0, selected=names[:SELECTED], deadline=0.0, started_at=0.0, action="swap")
    state = types.SimpleNamespace(assignments=assignments, _table=None)  # what EngineState's table reads
    table_of = getattr(EngineState, "_assignment_table", None)
    tabling = saving = 0.0
    for _ in range(SAVES):
        start = time.perf_counter()
        table = table_of(state) if table_of else {a: x.to_dict() for a, x in assignments.items()}
        tabling += time.perf_counter() - start
        start = time.perf_counter()
        store.save(Checkpoint(run_id="r", next_round=4, model_version=2, global_arrays={"w": np.zeros(8, np.float32)},
                              round_state=open_round, assignments=table))  # fmt: skip
        saving += time.perf_counter() - start
    print(f"per accepted update: assignments {1000 * tabling / SAVES:.1f} ms, save {1000 * saving / SAVES:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir())
