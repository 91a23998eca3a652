"""``state.json``'s text, kept item by item between writes (``broker_server.rounds.checkpoint``).

The state is written at every accepted update (or burst of them), and two of its parts grow with the round:
the round's update records and the replay window. Encoding the whole state again took 6.5 ms at 1,000 agents,
most of a write and O(N) for each of N updates a round (docs/results/scale.md). Each record's and each replay
entry's JSON is kept here from the write before and only new ones are encoded; the text is the same JSON
``common.files.json_text`` writes, read back by ``read_json`` (only the key order of two objects differs).
A record is immutable (``flcore.rounds.UpdateRecord`` is frozen), so one is known by identity.
"""

from __future__ import annotations

from common.files import json_text
from flcore.rounds import RoundState, UpdateRecord


def join_object(head: dict, encoded: dict[str, str]) -> str:
    """``head`` as a JSON object, with the keys of ``encoded`` after its own, each with its value's JSON text."""
    text = json_text(head)
    extra = ",".join(f"{json_text(key)}:{value}" for key, value in encoded.items())
    return f"{text[:-1]}{',' if head and extra else ''}{extra}}}"


class StateText:
    """The checkpoint's ``state.json`` as bytes, from the state and what this kept of the write before."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[UpdateRecord, str]] = {}  # id -> the record (kept alive) and its JSON
        self._replay: dict[tuple, str] = {}  # an entry (transfer id, created, sender) -> its JSON

    def encode(self, state: dict, round_state: RoundState | None, replay: list[list]) -> bytes:
        """``state`` with ``round_state`` (``RoundState.to_dict``'s content) and ``replay`` added."""
        records = {id(r): (r, self._record(r)) for r in round_state.updates} if round_state is not None else {}
        self._records = records
        entries: dict[tuple, str] = {}
        for entry in replay:
            key = tuple(entry)  # the whole entry: a rogue's transfer id remembered again is another entry
            entries[key] = self._replay.get(key) or json_text(entry)
        self._replay = entries
        rs = "null"
        if round_state is not None:
            rest = {k: v for k, v in vars(round_state).items() if k != "updates"}
            rs = join_object(rest, {"updates": f"[{','.join(records[id(r)][1] for r in round_state.updates)}]"})
        return join_object(state, {"replay": f"[{','.join(entries.values())}]", "round_state": rs}).encode()

    def _record(self, record: UpdateRecord) -> str:
        kept = self._records.get(id(record))
        return kept[1] if kept is not None and kept[0] is record else json_text(vars(record))
