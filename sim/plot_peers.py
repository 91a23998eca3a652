"""A peer run's plots (``skyfed sim --mode peer``: one ``metrics.jsonl`` row per peer and round, the BestAgg
election in ``election.json``): ``curves.png`` draws one curve per peer with the elected model marked,
``agents.png`` what each peer did each round and whose updates it aggregated or rejected."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from sim.plots import curve_panels, key_label, plt, round_axis, series
from sim.report_rows import elected_sha, label, names

NO_LINE, AGGREGATED, KEPT = 0, 1, 2  # a cell of the peers' grid: no row, a new aggregate, the aggregate refused
GRID_COLOURS = ("white", "tab:green", "tab:orange")
MAX_NAMED = 10  # peers named in a legend
MAX_SENDERS = 200  # columns of the who-aggregated-whom matrix; the senders named most often are kept
MAX_ANNOTATED = 300  # cells written with their counts; a bigger grid is colour only
MAX_GRID = 1000  # peers in the grid of rounds


@dataclass
class ElectedModel:
    """What the run's peers adopted at the end: the elected model (``sim.report_rows.elected_sha``), who holds it
    and whose model it was."""

    sha: str | None = None
    holders: set[str] = field(default_factory=set)
    owner: str | None = None

    @classmethod
    def read(cls, path: Path, attackers: list[str]) -> ElectedModel:
        try:
            records = json.loads(path.read_text()) if path.is_file() else {}
        except (ValueError, RecursionError):  # not JSON, or nested too deep
            records = {}
        records = {str(peer): e for peer, e in records.items() if isinstance(e, dict)
                   and isinstance(e.get("sha256"), str)} if isinstance(records, dict) else {}  # fmt: skip
        sha = elected_sha(records, attackers)
        holders = {peer for peer, e in records.items() if e["sha256"] == sha}
        owners = Counter(str(records[peer].get("adopted_from")) for peer in holders)
        return cls(sha, holders, owners.most_common(1)[0][0] if owners else None)

    def describe(self, peers: int) -> str:
        if self.sha is None:
            return "no model elected (no election.json)"
        adopted = f"adopted by {len(self.holders)} of {peers} peers"
        return f"★ elected: {label(self.owner)}'s model ({label(self.sha[:12])}), {adopted}"


def by_peer(rows: list[dict]) -> dict[str, list[dict]]:
    """Each peer's rows in round order."""
    peers: dict[str, list[dict]] = {}
    for r in rows:
        peers.setdefault(str(r.get("peer")), []).append(r)
    return {peer: sorted(lines, key=lambda r: r["round"]) for peer, lines in sorted(peers.items())}


def attackers_of(rows: list[dict]) -> list[str]:
    return sorted({a for r in rows for a in names(r.get("attackers"))})


def draw_peer_curves(rows: list[dict], election: ElectedModel) -> Figure:
    """The lead score (accuracy, or mAP@.5) per peer, beside it the loss (a detector: mAP@.5:.95), and where the
    senders reported it the trained C-SPE of each peer's round (``flcore.personal.claimed_personal``)."""
    first, second = curve_panels(rows)
    panels = [first[:1], second[:1], *([["trained_c_spe"]] if "trained_c_spe" in first else [])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5))
    for ax, keys in zip(axes, panels, strict=True):
        name = key_label(rows, keys[0]) if keys else None
        if name:
            _draw_peers(ax, rows, keys[0], election)
        ax.set(xlabel="round", ylabel=name or "score", title=f"Each peer's {name}" if name else "Nothing measured")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # more than MAX_NAMED peers and none elected: nothing named
            ax.legend(fontsize="x-small")
    fig.suptitle(election.describe(len(by_peer(rows))), fontsize="medium")
    return fig


def _draw_peers(ax: Axes, rows: list[dict], key: str, election: ElectedModel) -> None:
    """One curve per peer: solid for the peers that adopted the elected model, a star on its owner's last round
    (the model it put up for election), dotted red for attackers."""
    peers, attackers = by_peer(rows), set(attackers_of(rows))
    for peer, lines in peers.items():
        held, attacker = peer in election.holders, peer in attackers
        what = " (attacker)" if attacker else " (adopted it)" if held else " (kept another)" if election.sha else ""
        shown = len(peers) <= MAX_NAMED or peer == election.owner
        line, = ax.plot([r["round"] for r in lines], series(lines, key), marker=".",
                        linestyle=":" if attacker else "-" if held else "--", linewidth=2.2 if held else 1.0,
                        color="tab:red" if attacker else None, label=label(peer) + what if shown else None)  # fmt: skip
        if peer == election.owner:
            ax.plot(lines[-1]["round"], series(lines[-1:], key)[0], marker="*", markersize=16, linestyle="none",
                    color=line.get_color(), label="elected model")  # fmt: skip


def peer_grid(rows: list[dict]) -> tuple[list[str], list[int], np.ndarray, np.ndarray]:
    """Peers (the ``MAX_GRID`` with the most rows: a file naming a new peer and round per line must not make a grid
    of lines squared), rounds, per peer and round its outcome (``AGGREGATED`` …) and how many updates it aggregated."""
    every = by_peer(rows)
    peers = {p: every[p] for p in sorted(sorted(every, key=lambda p: -len(every[p]))[:MAX_GRID])}
    rounds = sorted({r["round"] for lines in peers.values() for r in lines})
    column = {n: i for i, n in enumerate(rounds)}
    outcome = np.full((len(peers), len(rounds)), NO_LINE, dtype=np.int8)
    counts = np.zeros((len(peers), len(rounds)), dtype=np.int32)
    for i, lines in enumerate(peers.values()):
        for r in lines:
            outcome[i, column[r["round"]]] = AGGREGATED if r.get("outcome", "aggregated") == "aggregated" else KEPT
            counts[i, column[r["round"]]] = len(names(r.get("aggregated_from")))
    return list(peers), rounds, outcome, counts


def sender_matrix(rows: list[dict]) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
    """Per receiving peer and sender: the rounds it aggregated the sender's update, and the rounds it rejected
    one; the ``MAX_SENDERS`` senders named most often, peers first."""
    peers = by_peer(rows)
    named = Counter(s for r in rows for s in (*names(r.get("aggregated_from")), *names(r.get("rejected"), "peer")))
    senders = sorted(({*peers} | {s for s, _ in named.most_common(MAX_SENDERS)}), key=lambda s: (s not in peers, s))
    senders = senders[:MAX_SENDERS]
    column = {s: i for i, s in enumerate(senders)}
    taken = np.zeros((len(peers), len(senders)), dtype=int)
    refused = np.zeros_like(taken)
    for i, lines in enumerate(peers.values()):
        for r in lines:
            for matrix, sent in ((taken, names(r.get("aggregated_from"))), (refused, names(r.get("rejected"), "peer"))):
                for sender in (s for s in sent if s in column):
                    matrix[i, column[sender]] += 1
    return list(peers), senders, taken, refused


def draw_peer_rounds(rows: list[dict]) -> Figure:
    peers, rounds, outcome, counts = peer_grid(rows)
    _, senders, taken, refused = sender_matrix(rows)
    fig, (ax_grid, ax_from) = plt.subplots(1, 2, figsize=(12, max(3.5, min(12.0, 0.3 * len(peers) + 2))))
    ax_grid.imshow(outcome, aspect="auto", interpolation="nearest", vmin=0, vmax=len(GRID_COLOURS) - 1,
                   cmap=matplotlib.colors.ListedColormap(GRID_COLOURS))  # fmt: skip
    round_axis(ax_grid, rounds)
    handles = [matplotlib.patches.Patch(color=c, label=n) for c, n in
               zip(GRID_COLOURS[1:], ("aggregated", "aggregate refused (kept its model)"), strict=True)]  # fmt: skip
    ax_grid.legend(handles=handles, fontsize="x-small", loc="upper left", bbox_to_anchor=(0, -0.12), ncol=2)
    ax_grid.set(xlabel="round", ylabel="peer", title="Each peer's rounds (cells: updates aggregated)")
    if outcome.size <= MAX_ANNOTATED:
        for (i, j), n in np.ndenumerate(counts):
            if outcome[i, j] != NO_LINE:
                ax_grid.text(j, i, str(n), ha="center", va="center", fontsize="x-small")
    ax_from.imshow(taken, aspect="auto", interpolation="nearest", cmap="Greens", vmin=0, vmax=max(1, len(rounds)))
    if taken.size <= MAX_ANNOTATED:
        for (i, j), n in np.ndenumerate(taken):
            text = f"{n}" + (f" ✗{refused[i, j]}" if refused[i, j] else "")
            colour = "tab:red" if refused[i, j] else "white" if n > len(rounds) / 2 else "black"
            ax_from.text(j, i, text, ha="center", va="center", fontsize="x-small", color=colour)
    ax_from.set(xlabel="sender", ylabel="peer",
                title=f"Rounds each peer aggregated whom (✗ rejected: {int(refused.sum())} updates)")  # fmt: skip
    if len(senders) <= 40:
        ax_from.set_xticks(range(len(senders)), [label(s) for s in senders], rotation=60, ha="right",
                           fontsize="x-small")  # fmt: skip
    for ax in (ax_grid, ax_from):
        if len(peers) <= 40:
            ax.set_yticks(range(len(peers)), [label(p) for p in peers], fontsize="x-small")
    return fig

