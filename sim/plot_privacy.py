"""``privacy.png``: ε after each round, the server's (the worst agent's, central DP) and each agent's own (local
DP-SGD), for runs that spend a privacy budget."""

from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from sim.plots import plt
from sim.report_rows import drawable, label


def has_privacy(rows: list[dict]) -> bool:
    return any(r.get("privacy") or "local_epsilon" in _aggregation(r) for r in rows)


def _aggregation(row: dict) -> dict:
    aggregation = row.get("aggregation")
    return aggregation if isinstance(aggregation, dict) else {}


def draw_privacy(rows: list[dict]) -> Figure:
    """A round that published a model without noise makes the central ε infinite: drawn as a gap, said in the
    title."""
    rounds = [r["round"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    central = [r.get("privacy") if isinstance(r.get("privacy"), dict) else {} for r in rows]
    unbounded = any(p and p.get("epsilon") is None for p in central)
    if any(central):
        ax.plot(rounds, [drawable(p.get("epsilon")) for p in central], marker="o", label="central ε (worst agent)")
        target = next((drawable(p["target_epsilon"]) for p in central if p and p.get("target_epsilon")), math.nan)
        if math.isfinite(target):
            ax.axhline(target, linestyle="--", color="grey", label=f"target ε = {target:g}")
    local = [e if isinstance(e := _aggregation(r).get("local_epsilon"), dict) else {} for r in rows]
    agents = sorted({a for per_round in local for a in per_round})
    for agent in agents:
        ax.plot(rounds, [drawable(per_round.get(agent)) for per_round in local], marker=".", alpha=0.6,
                label=f"local ε {label(agent)}" if len(agents) <= 8 else None)  # fmt: skip
    title = "Privacy budget spent" + (" (a model went out without noise: central ε is infinite)" if unbounded else "")
    ax.set(xlabel="round", ylabel="ε", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="x-small")
    ax.grid(True, alpha=0.3)
    return fig
