"""The lines ``skyfed sim`` prints when a run ends, one per thing the run is judged by: the saved global
model's score, and besides it what the shape and kind of model optimize (docs/architecture.md, "One
headline per shape and kind of model") — the personal models' C-SPE and C-GEN (start and trained), the model the peers
elected and who holds it, each region's last round."""

from __future__ import annotations

import json
from pathlib import Path

from protocol.messages import MessageError, RoundMetrics, headline
from protocol.scores import headline_text


def summary_lines(out: Path, metrics: list[RoundMetrics], final_eval: dict, *, seconds: float,
                  attackers: list[str] = ()) -> list[str]:  # fmt: skip
    """``attackers``: peers whose decision the election leaves out (``sim.report_rows.elected_sha``)."""
    score = headline(final_eval)
    name = "mAP@.5" if "map50" in final_eval else "accuracy"
    lines = [f"done in {seconds:.1f} s; final {name} {score}; results in {out}/"]
    kept = [m for m in metrics if m.models != "global" and m.headline and m.headline[0]["key"] == "c_spe"]
    if kept:
        m = kept[-1]
        lines.append(f"personal models ({m.models}): {headline_text(m.headline, width=4)} (round {m.round}: the "
                     "models agents started it from, and trained; the global model's score above is not what this "
                     "strategy optimizes)")  # fmt: skip
    lines += _election_lines(out / "election.json", list(attackers))
    lines += [_region_line(p) for p in sorted((out / "regions").glob("*/metrics.jsonl"))]
    return lines


def _election_lines(path: Path, attackers: list[str]) -> list[str]:
    """Which peers hold the elected model (``sim.report_rows.elected_sha``, the one the sim saved), from the sim's
    ``election.json``; a decision that is not an object with a ``sha256`` is left out."""
    if not path.exists():
        return []
    from sim.report_rows import elected_sha

    read = json.loads(path.read_text())
    elections = {name: e for name, e in read.items() if isinstance(e, dict) and isinstance(e.get("sha256"), str)}
    sha = elected_sha(elections, attackers)
    if sha is None:
        return ["no peer elected a model"]
    holders = sorted(name for name, e in elections.items() if e["sha256"] == sha)
    return [f"elected model {sha[:12]}: held by {len(holders)} of {len(read)} peers ({', '.join(holders)})"]


def _region_line(path: Path) -> str:
    region = path.parent.name
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        last = RoundMetrics.from_json(rows[-1]) if rows else None
    except MessageError as exc:
        return f"{region}: unreadable metrics ({exc})"
    if last is None:
        return f"{region}: no round closed"
    return f"{region}: {len(rows)} rounds, last round {last.round} {last.outcome}  {headline_text(last.headline)}"
