"""A run's ``metrics.jsonl`` as ``skyfed report`` reads it: every line checked (a truncated or forged line is
skipped with its reason, never a crash), and names and numbers made safe to draw."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.scores import row_headline

MAX_ROUND = 10**9  # a round number beyond this is not a round any run reached
MAX_VALUE = 1e12  # a score or loss beyond this is drawn as a gap: it would squash every other point
MAX_NAME = 32  # characters of a name drawn on a plot


def elected_sha(elections: dict[str, dict], attackers: list[str]) -> str | None:
    """The model the honest peers adopted most often in the BestAgg election (None: none adopted one)."""
    votes = Counter(e["sha256"] for name, e in elections.items() if name not in attackers)
    return votes.most_common(1)[0][0] if votes else None


@dataclass
class Rows:
    rows: list[dict] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason → lines


def load_rows(path: Path) -> Rows:
    """The lines that are rounds, in file order, and how many were skipped and why."""
    loaded = Rows()
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # a line cut short by a crash, not JSON at all, or nested too deep
            row = None
        if (why := _refusal(row)) is not None:
            loaded.skipped[why] = loaded.skipped.get(why, 0) + 1
            continue
        loaded.rows.append({**row, "eval": _mapping(row.get("eval")), "personal": _mapping(row.get("personal"))})
    return loaded


def read_rows(path: Path) -> list[dict]:
    return load_rows(path).rows


def _refusal(row: Any) -> str | None:
    if not isinstance(row, dict):
        return "not a JSON object"
    number = row.get("round")
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= MAX_ROUND:
        return f"round not a whole number from 0 to {MAX_ROUND}"
    return None


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def names(value: Any, key: str | None = None) -> list[str]:
    """The names a row lists (``accepted``), or with ``key`` the ``key`` of each entry (``rejected``' agents)."""
    if not isinstance(value, list):
        return []
    if key is None:
        return [str(v) for v in value]
    return [str(v[key]) for v in value if isinstance(v, dict) and key in v]


def label(name: Any) -> str:
    """``name`` as plain text on a plot: cut to ``MAX_NAME``, one line, no mathtext (``$``), never hidden from a
    legend (matplotlib drops labels that start with ``_``)."""
    text = " ".join(str(name).split())
    text = text if len(text) <= MAX_NAME else text[: MAX_NAME - 1] + "…"
    text = text.replace("$", r"\$")
    return "\u200b" + text if text.startswith("_") else text


def drawable(value: Any) -> float:
    """A number for a plot: NaN (a gap) for anything missing, not a number, or beyond ``MAX_VALUE``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value) if abs(value) <= MAX_VALUE else math.nan


def scores(row: dict) -> dict[str, dict]:
    """A row's headline (``protocol.scores.row_headline``) by key."""
    return {s["key"]: s for s in row_headline(row)}


def is_detector(rows: list[dict]) -> bool:
    return any("map50" in r["eval"] for r in rows)


def is_peer_run(rows: list[dict]) -> bool:
    """Rows written one per peer and round (``skyfed sim --mode peer``) rather than one per server round."""
    return any(r.get("mode") == "peer" or "peer" in r for r in rows)
