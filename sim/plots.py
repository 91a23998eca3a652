"""Plots of a run's ``metrics.jsonl``, written as PNG: the global model's curves (``curves.png``), each
agent's rounds (``agents.png``) and the privacy budget (``privacy.png``, for runs that have one)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # headless: drones and CI have no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# a cell of the agents' grid: what the round did with that agent
NOT_SELECTED, ACCEPTED, MISSED, REFUSED = 0, 1, 2, 3
GRID_COLOURS = ("white", "tab:green", "tab:orange", "tab:red")


def read_rows(metrics_path: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    rows = read_rows(metrics_path)
    rounds = [r["round"] for r in rows]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    detect = any("map50" in r["eval"] for r in rows)
    ax_acc.plot(rounds, [r["eval"].get("map50" if detect else "accuracy") for r in rows], marker="o", label="global")
    for key, name in (("c_spe", "C-SPE (start model, own test split)"), ("c_gen", "C-GEN (start model, server set)")):
        if any(key in r.get("personal", {}) for r in rows):  # issue 22: the models agents trained from
            ax_acc.plot(rounds, [r.get("personal", {}).get(key) for r in rows], marker=".", label=name)
    label = "mAP@.5" if detect else "test accuracy"
    ax_acc.set(xlabel="round", ylabel=label, title=f"Global model {label}")
    ax_acc.legend(fontsize="small")
    ax_acc.grid(True, alpha=0.3)
    ax_loss.plot(rounds, [r["eval"].get("loss") for r in rows], marker="o", color="tab:red")
    ax_loss.set(xlabel="round", ylabel="test loss", title="Global model loss")
    ax_loss.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def agent_grid(rows: list[dict]) -> tuple[list[str], np.ndarray]:
    """Every agent a round named, and per agent and round what happened to it (``ACCEPTED`` …); an agent
    both refused and accepted in a round (a refused re-send) counts as accepted."""
    agents = sorted({a for r in rows for a in (*r["accepted"], *r.get("missed", []))}
                    | {x["agent"] for r in rows for x in r["rejected"]})  # fmt: skip
    index = {a: i for i, a in enumerate(agents)}
    grid = np.full((len(agents), len(rows)), NOT_SELECTED)
    for column, r in enumerate(rows):
        for agent in r.get("missed", []):
            grid[index[agent], column] = MISSED
        for refusal in r["rejected"]:
            grid[index[refusal["agent"]], column] = REFUSED
        for agent in r["accepted"]:
            grid[index[agent], column] = ACCEPTED
    return agents, grid


def plot_agents(metrics_path: Path, png_path: Path) -> None:
    """Per agent: its rounds (accepted, missed, refused) and, where agents report it, its C-SPE."""
    rows = read_rows(metrics_path)
    agents, grid = agent_grid(rows)
    rounds = [r["round"] for r in rows]
    fig, (ax_grid, ax_spe) = plt.subplots(1, 2, figsize=(11, max(3.0, min(12.0, 0.25 * len(agents) + 1.5))))
    ax_grid.imshow(grid, aspect="auto", interpolation="nearest", vmin=0, vmax=len(GRID_COLOURS) - 1,
                   cmap=matplotlib.colors.ListedColormap(GRID_COLOURS),
                   extent=(rounds[0] - 0.5, rounds[-1] + 0.5, len(agents) - 0.5, -0.5) if rounds else None)  # fmt: skip
    if len(agents) <= 40:
        ax_grid.set_yticks(range(len(agents)), agents, fontsize="x-small")
    handles = [matplotlib.patches.Patch(color=c, label=n) for c, n in
               zip(GRID_COLOURS[1:], ("accepted", "missed", "refused"), strict=True)]  # fmt: skip
    ax_grid.legend(handles=handles, fontsize="x-small", loc="upper right")
    ax_grid.set(xlabel="round", ylabel="agent", title="Each agent's rounds")
    personal = [r.get("personal", {}).get("agents", {}) for r in rows]
    shown = [a for a in agents if any("c_spe" in p.get(a, {}) for p in personal)]
    for agent in shown:
        ax_spe.plot(rounds, [p.get(agent, {}).get("c_spe") for p in personal], marker=".", alpha=0.6,
                    label=agent if len(shown) <= 10 else None)  # fmt: skip
    if shown and len(shown) <= 10:
        ax_spe.legend(fontsize="x-small")
    ax_spe.set(xlabel="round", ylabel="accuracy on its own test split",
               title="Each agent's start model (C-SPE)" if shown else
               "No per-agent C-SPE (no agent.test_data, or central DP)")  # fmt: skip
    ax_spe.grid(True, alpha=0.3)
    for axes in (ax_grid, ax_spe):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def has_privacy(metrics_path: Path) -> bool:
    return any(r.get("privacy") or "local_epsilon" in r.get("aggregation", {}) for r in read_rows(metrics_path))


def plot_privacy(metrics_path: Path, png_path: Path) -> None:
    """ε after each round: the server's (the worst agent's, central DP) and each agent's own (local DP-SGD).
    A round that published a model without noise makes the central ε infinite: drawn as a gap, said in the title."""
    rows = read_rows(metrics_path)
    rounds = [r["round"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    central = [r.get("privacy", {}) for r in rows]
    unbounded = any(p and p.get("epsilon") is None for p in central)
    if any(central):
        values = [p.get("epsilon") if p else None for p in central]
        ax.plot(rounds, [math.nan if v is None else v for v in values], marker="o", label="central ε (worst agent)")
        target = next((p["target_epsilon"] for p in central if p and p.get("target_epsilon")), None)
        if target is not None:
            ax.axhline(target, linestyle="--", color="grey", label=f"target ε = {target:g}")
    local = [r.get("aggregation", {}).get("local_epsilon", {}) for r in rows]
    agents = sorted({a for per_round in local for a in per_round})
    for agent in agents:
        ax.plot(rounds, [per_round.get(agent, math.nan) for per_round in local], marker=".", alpha=0.6,
                label=f"local ε {agent}" if len(agents) <= 8 else None)  # fmt: skip
    title = "Privacy budget spent" + (" (a model went out without noise: central ε is infinite)" if unbounded else "")
    ax.set(xlabel="round", ylabel="ε", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="x-small")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
