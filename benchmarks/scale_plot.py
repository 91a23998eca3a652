"""``python -m benchmarks.scale_plot ROWS.jsonl OUT.png``: the rows ``benchmarks.scale`` printed (one JSON object
per line), drawn against N: each role's peak memory, and the time to the first round and per round."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def shape_of(row: dict) -> str:
    """``regions``, ``flat`` (the server's default strategy) or ``flat, fedavg``."""
    if row["regions"]:
        return "regions"
    return "flat, fedavg" if row.get("strategy") == "fedavg" else "flat"


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, time) = plt.subplots(1, 2, figsize=(11, 4))
    for shape, marker in (("flat", "s"), ("flat, fedavg", "^"), ("regions", "o")):
        picked = sorted((r for r in rows if shape_of(r) == shape), key=lambda r: r["agents"])
        if not picked:
            continue
        n = [r["agents"] for r in picked]
        for role, label in (("root_mb", "server (root)"), ("region_mb", "regional servers, all"),
                            ("broker_mb", "brokers, all")):  # fmt: skip
            if all(role in r for r in picked):
                memory.plot(n, [r[role] for r in picked], marker=marker, label=f"{label}, {shape}")
        time.plot(n, [r["first_round_s"] for r in picked], marker=marker, label=f"first round, {shape}")
        time.plot(n, [r["round_s"] for r in picked], marker=marker, linestyle="--", label=f"round, {shape}")
    memory.set(xscale="log", xlabel="agents", ylabel="peak private memory (MB)", title="memory per role")
    time.set(xscale="log", yscale="log", xlabel="agents", ylabel="seconds", title="time (2 shared cores)")
    for axes in (memory, time):
        axes.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    plot([json.loads(line) for line in source.read_text().splitlines() if line.strip()], target)
