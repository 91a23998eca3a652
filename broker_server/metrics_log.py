"""``metrics.jsonl``: one JSON object per finished round, appended durably, never duplicated or lost.

The checkpoint carries the last round's metrics; after a crash between checkpoint and append,
``reconcile`` appends the line the file is missing, so every committed or rolled-back round appears
exactly once.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from protocol.messages import RoundMetrics

log = logging.getLogger("skyfed.server")


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, metrics: RoundMetrics) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as handle:
            handle.write(metrics.to_json() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())

    def last_round(self) -> int | None:
        if not self.path.exists():
            return None
        lines = self.path.read_bytes().splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line)["round"])
            except (ValueError, KeyError, TypeError):
                continue
        return None

    def reconcile(self, last: dict | None) -> None:
        """Append the checkpoint's last metrics if the file does not end with that round."""
        if last is None:
            return
        metrics = RoundMetrics.from_dict(last)
        if self.last_round() != metrics.round:
            self.append(metrics)


def log_round(m: RoundMetrics) -> None:
    """One journal line per closed round."""
    log.info(
        "round closed round=%d outcome=%s accepted=%d/%d rejected=%d accuracy=%s loss=%s aggregate_ms=%.2f "
        "version=%d clipped=%s",
        m.round,
        m.outcome,
        len(m.accepted),
        len(m.participants),
        len(m.rejected),
        m.eval.get("accuracy"),
        m.eval.get("loss"),
        m.aggregate_s * 1e3,
        m.model_version,
        ",".join(m.aggregation.get("clipped", [])) or "-",
    )
