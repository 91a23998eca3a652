"""The lines ``skyfed sim`` prints when a run ends, one per thing the run is judged by: the saved global
model's score, and besides it what the shape and kind of model optimize (docs/architecture.md, "One
headline per shape and kind of model") — the personal models' C-SPE and C-GEN, the model the peers
elected and who holds it, each region's last round."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from protocol.messages import MessageError, RoundMetrics, headline
from protocol.scores import headline_text


def summary_lines(out: Path, metrics: list[RoundMetrics], final_eval: dict, *, seconds: float) -> list[str]:
    score = headline(final_eval)
    name = "mAP@.5" if "map50" in final_eval else "accuracy"
    lines = [f"done in {seconds:.1f} s; final {name} {score}; results in {out}/"]
    kept = [m for m in metrics if m.models != "global" and m.headline and m.headline[0]["key"] == "c_spe"]
    if kept:
        m = kept[-1]
        lines.append(f"personal models ({m.models}): {headline_text(m.headline)} (round {m.round}, the models "
                     "agents started it from; the global model's score above is not what this strategy optimizes)")
    lines += _election_lines(out / "election.json")
    lines += [_region_line(p) for p in sorted((out / "regions").glob("*/metrics.jsonl"))]
    return lines


def _election_lines(path: Path) -> list[str]:
    """Which peers hold the elected model (the one most peers adopted), from the sim's ``election.json``."""
    if not path.exists():
        return []
    elections = json.loads(path.read_text())
    votes = Counter(e.get("sha256") for e in elections.values())
    if not votes:
        return ["no peer elected a model"]
    sha, count = votes.most_common(1)[0]
    holders = sorted(name for name, e in elections.items() if e.get("sha256") == sha)
    return [f"elected model {str(sha)[:12]}: held by {count} of {len(elections)} peers ({', '.join(holders)})"]


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
