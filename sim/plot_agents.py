"""``agents.png`` of a server's run: what each round did with each participant (an agent, or at a region run's
root a region), and each agent's own score where agents report one (C-SPE: accuracy, or mAP@.5 for a
detector, of the model it started the round from, on its own split)."""

from __future__ import annotations

from collections import Counter

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from sim.plots import curve_panels, key_label, plt, round_axis, series
from sim.report_rows import drawable, is_detector, label, names

# a cell of the agents' grid: what the round did with that agent
NOT_SELECTED, ACCEPTED, MISSED, REFUSED = 0, 1, 2, 3
GRID_COLOURS = ("white", "tab:green", "tab:orange", "tab:red")
LAYERS = ((MISSED, "missed", None), (REFUSED, "rejected", "agent"), (ACCEPTED, "accepted", None))  # later wins
MAX_TICKS = 40  # participants named on the axis; more are drawn unnamed
MAX_NAMED = 10  # curves named in a legend
MAX_GRID = 1000  # agents in the grid: more rows than a figure has pixels show nothing more


def named(rows: list[dict]) -> Counter[str]:
    """How many times the rounds name each agent."""
    return Counter(a for r in rows for _, key, field in LAYERS for a in names(r.get(key), field))


def agent_grid(rows: list[dict]) -> tuple[list[str], np.ndarray]:
    """The agents the rounds name (the ``MAX_GRID`` named most often: a file naming a new agent per line must not
    make a grid of lines squared), and per agent and round what happened to it (``ACCEPTED`` …); an agent both
    refused and accepted in a round (a refused re-send) counts as accepted."""
    agents = sorted(a for a, _ in named(rows).most_common(MAX_GRID))
    index = {a: i for i, a in enumerate(agents)}
    grid = np.full((len(agents), len(rows)), NOT_SELECTED, dtype=np.int8)
    for column, r in enumerate(rows):
        for state, key, field in LAYERS:
            for agent in names(r.get(key), field):
                if (row := index.get(agent)) is not None:
                    grid[row, column] = state
    return agents, grid


def regions_of(rows: list[dict]) -> dict[str, int]:
    """A region run's root: each region's number of agents (``sim.region_run`` adds ``regions``); else {}."""
    members = next((r["regions"] for r in reversed(rows) if isinstance(r.get("regions"), dict)), {})
    return {str(region): len(agents) if isinstance(agents, list) else 0 for region, agents in members.items()}


def draw_agents(rows: list[dict], regional: dict[str, list[dict]] | None = None) -> Figure:
    """``regional``: at a region run's root, each region's own rows (``regions/<region>/metrics.jsonl``)."""
    agents, grid = agent_grid(rows)
    regions = regions_of(rows)
    noun = "region" if regions else "agent"
    fig, (ax_grid, ax_own) = plt.subplots(1, 2, figsize=(11, max(3.0, min(12.0, 0.25 * len(agents) + 1.5))))
    ax_grid.imshow(grid, aspect="auto", interpolation="nearest", vmin=0, vmax=len(GRID_COLOURS) - 1,
                   cmap=matplotlib.colors.ListedColormap(GRID_COLOURS))  # fmt: skip
    round_axis(ax_grid, [r["round"] for r in rows])
    if len(agents) <= MAX_TICKS:
        ticks = [label(a) + (f" ({regions[a]} agents)" if a in regions else "") for a in agents]
        ax_grid.set_yticks(range(len(agents)), ticks, fontsize="x-small")
    handles = [matplotlib.patches.Patch(color=c, label=n) for c, n in
               zip(GRID_COLOURS[1:], ("accepted", "missed", "refused"), strict=True)]  # fmt: skip
    ax_grid.legend(handles=handles, fontsize="x-small", loc="upper right")
    more = f" ({len(named(rows)) - len(agents)} more not drawn)" if len(agents) == MAX_GRID else ""
    ax_grid.set(xlabel="round", ylabel=noun, title=f"Each {noun}'s rounds{more}")
    if regional:
        _draw_regions(ax_own, regional)
    else:
        _draw_own_scores(ax_own, rows, agents, noun)
    if ax_own.lines and len(ax_own.lines) <= MAX_NAMED:
        ax_own.legend(fontsize="x-small")
    ax_own.grid(True, alpha=0.3)
    ax_own.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _draw_own_scores(ax: Axes, rows: list[dict], agents: list[str], noun: str) -> None:
    """Each agent's C-SPE: its headline score (accuracy, or mAP@.5) of the model it started from, on its split."""
    personal = [p if isinstance(p := r["personal"].get("agents"), dict) else {} for r in rows]
    shown = [a for a in agents if any(isinstance(p.get(a), dict) and "c_spe" in p[a] for p in personal)]
    for agent in shown:
        values = [drawable(p[agent].get("c_spe")) if isinstance(p.get(agent), dict) else np.nan for p in personal]
        ax.plot([r["round"] for r in rows], values, marker=".", alpha=0.6,
                label=label(agent) if len(shown) <= MAX_NAMED else None)  # fmt: skip
    metric, split = ("mAP@.5", "val") if is_detector(rows) else ("accuracy", "test")
    why = "see regions/<region>/agents.png" if noun == "region" else "no agent.test_data, or central DP"
    title = f"Each {noun}'s start model: C-SPE ({metric})" if shown else f"No per-{noun} C-SPE ({why})"
    ax.set(xlabel="round", ylabel=f"{metric} on its own {split} split", title=title)


def _draw_regions(ax: Axes, regional: dict[str, list[dict]]) -> None:
    """Each region's aggregate, by the lead score of its own server's evaluation."""
    every = [r for lines in regional.values() for r in lines]
    first, _ = curve_panels(every)
    name = key_label(every, first[0]) if first else "score"
    for region, lines in regional.items():
        if first:
            ax.plot([r["round"] for r in lines], series(lines, first[0]), marker=".",
                    label=label(region) if len(regional) <= MAX_NAMED else None)  # fmt: skip
    ax.set(xlabel="round (the region's)", ylabel=name, title=f"Each region's aggregate: {name}")
