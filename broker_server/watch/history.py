"""``server/history``: a retained, bounded summary of the run's last rounds, for a dashboard opened late.

``server/metrics`` is not retained, so a page that connects at round 40 would see nothing of rounds 1-39.
The server keeps one small row per round (its headline scores, loss, ε, bytes, accepted/rejected counts) and
republishes the last rows, retained, after every round: at most ``max_rounds`` rows and ``max_bytes`` of
JSON, oldest dropped first, so a WebSockets client reads it in well under a second. A row names its scores by
key with six significant digits; the payload's ``labels`` says once what each key is called (protocol/scores.py),
which keeps a row near 200 bytes. Seeded from
``metrics.jsonl`` at start, so a restarted server still serves the whole (bounded) run.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from common.untrusted_json import UntrustedJsonError, parse_untrusted_json
from protocol.messages import MessageError, RoundMetrics, finite_or_null
from protocol.scores import GLOBAL_KEYS, LABELS, PERSONAL_KEYS

log = logging.getLogger("skyfed.server")

SCHEMA = "skyfed.history/2"  # /2: rows carry ``headline`` (and the payload ``labels``) instead of ``score``
MAX_ROUNDS = 500
MAX_BYTES = 64 << 10
MAX_RUN_ID = 64  # characters of a run id a reader keeps (a server's is 12 hex digits)
HEADLINE_WIDTH = 6  # the scores a row keeps, lead first: what the dashboard's rounds table shows


def short(value: object) -> object:
    """A number to six significant digits (what a chart or a table shows); anything else as it is."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    return value


def history_row(metrics: RoundMetrics) -> dict:
    """One round's numbers, as the dashboard plots them: ``headline`` is ``[[key, value], …]``, lead first; a
    number the round does not have (no ε without differential privacy) is left out."""
    row = finite_or_null({
        "round": metrics.round,
        "outcome": metrics.outcome,
        "headline": [[s["key"], short(s["value"])] for s in metrics.headline[:HEADLINE_WIDTH]],
        "loss": short(metrics.eval.get("loss")),
        "epsilon": short(metrics.privacy.get("epsilon")),
        "bytes_up": metrics.bytes_up,
        "bytes_down": metrics.bytes_down,
        "accepted": len(metrics.accepted),
        "rejected": len(metrics.rejected),
        "finished_at": round(metrics.finished_at, 1),
        "staleness": short(metrics.buffer.get("staleness_mean")),  # asynchronous rounds
        "lost": sum(n for n in metrics.wasted.values() if isinstance(n, int)) or None,  # refused late or stale
    })  # fmt: skip
    return {k: v for k, v in row.items() if v is not None}


class RunHistory:
    """The last rounds' rows, bounded in count and in encoded size."""

    def __init__(self, federation: str, *, max_rounds: int = MAX_ROUNDS, max_bytes: int = MAX_BYTES) -> None:
        self.federation = federation
        self.max_bytes = max_bytes
        self.rows: deque[dict] = deque(maxlen=max_rounds)
        self.labels: dict[str, str] = {}  # score key -> what it is called (its label in RoundMetrics.headline)
        self.run_id = ""  # the server run of the rows (metrics.jsonl holds one run: a new one sets it aside)

    def add(self, metrics: RoundMetrics) -> None:
        self.rows.append(history_row(metrics))
        self.labels.update((s["key"], s["label"]) for s in metrics.headline[:HEADLINE_WIDTH])
        self.run_id = metrics.run_id

    def payload(self) -> bytes:
        """The retained message: the newest rows that fit ``max_bytes`` (oldest dropped first)."""
        while True:
            body = {"schema": SCHEMA, "federation": self.federation, "run_id": self.run_id, "labels": self.labels,
                    "rounds": list(self.rows)}  # fmt: skip
            data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
            if len(data) <= self.max_bytes or not self.rows:
                return data
            self.rows.popleft()

    def seed(self, metrics_jsonl: Path) -> None:
        """Rows from a previous run of this state directory; an unreadable line is skipped and logged."""
        if not metrics_jsonl.exists():
            return
        for number, line in enumerate(metrics_jsonl.read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                self.add(RoundMetrics.from_json(line))
            except (MessageError, ValueError) as exc:
                log.warning("event=history-line-skipped file=%s line=%d error=%s", metrics_jsonl, number, exc)


@dataclass(frozen=True)
class PastRounds:
    """``server/history`` as a reader takes it (``read_history``): what each score key is called, and the rows."""

    labels: dict[str, str] = field(default_factory=dict)
    rows: tuple[dict, ...] = ()
    run_id: str = ""  # the server run they belong to ("": a server that does not say)


def read_history(payload: bytes) -> PastRounds:
    """The rows of a ``server/history`` payload that are well formed, oldest first, or ``MessageError``: anyone
    who may publish there could put anything there, so a row needs an integer ``round`` and a string ``outcome``,
    its ``headline`` keeps only [key, number] pairs of the scores ``protocol.scores`` knows, and what each is
    called comes from there too, never from the payload (a reader shows every other value as plain text)."""
    try:
        body = parse_untrusted_json(payload, max_bytes=MAX_BYTES)
    except UntrustedJsonError as exc:
        raise MessageError(f"server/history: {exc}") from None
    if not isinstance(body, dict) or body.get("schema") != SCHEMA or not isinstance(body.get("rounds"), list):
        raise MessageError(f"server/history: not a {SCHEMA} payload")
    rows = []
    for row in body["rounds"][-MAX_ROUNDS:]:
        if isinstance(row, dict) and type(row.get("round")) is int and isinstance(row.get("outcome"), str):
            pairs = row.get("headline") if isinstance(row.get("headline"), list) else []
            known = {p[0]: p[1] for p in pairs if isinstance(p, list) and len(p) == 2 and p[0] in LABELS
                     and type(p[1]) in (int, float)}  # fmt: skip
            rows.append({**row, "headline": list(known.items())[:HEADLINE_WIDTH]})
    personal = any(r["headline"] and r["headline"][0][0] in PERSONAL_KEYS for r in rows)  # its lead: kept models
    labels = {k: f"global {label}" if personal and k in GLOBAL_KEYS else label for k, label in LABELS.items()}
    run_id = body.get("run_id")
    return PastRounds(labels, tuple(rows), run_id if isinstance(run_id, str) and len(run_id) <= MAX_RUN_ID else "")
