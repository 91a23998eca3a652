"""``curves.png`` of a server's run: what the run optimizes first (docs/architecture.md, "One headline per shape
and kind of model"), its loss beside it. Each agent's rounds are ``sim.plot_agents``', a peer run's
``sim.plot_peers``', the privacy budget ``sim.plot_privacy``'."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: drones and CI have no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

from protocol.scores import MODEL_KINDS, headline_order  # noqa: E402
from sim.report_rows import drawable, read_rows, scores  # noqa: E402

KINDS = {"global": "Global model", "group": "Each group's model", "agent": "Each agent's own model"}
MEANINGS = {"c_spe": "C-SPE (start model, own test split)", "c_gen": "C-GEN (start model, server set)",
            "trained_c_spe": "trained C-SPE (own test split)", "trained_c_gen": "trained C-GEN (server set)"}
EXTRA = ("precision", "recall")  # a detector's evaluation holds them outside any headline


def run_models(rows: list[dict]) -> str:
    """What the run's agents keep, as its last round says (a run written before ``models`` existed: global)."""
    models = rows[-1].get("models", "global") if rows else "global"
    return models if models in MODEL_KINDS else "global"


def curve_panels(rows: list[dict]) -> tuple[list[str], list[str]]:
    """The keys of the two panels, in headline order: the scores (the lead first), then the losses or, for a
    detector evaluated without a loss, mAP@.5:.95, precision and recall, so no panel is drawn empty."""
    held = {k for r in rows for k in scores(r)} | {k for r in rows for k in EXTRA if k in r["eval"]}
    keys = [k for k in (*headline_order(run_models(rows)), *EXTRA) if k in held]
    losses = [k for k in keys if k.endswith("loss")]
    second = losses or [k for k in keys if k in ("map50_95", *EXTRA)]
    return [k for k in keys if k not in second], second


def series(rows: list[dict], key: str) -> list[float]:
    """``key`` per round: the headline's value, or the evaluation's for a number outside the headline."""
    held = [scores(r) for r in rows]
    return [drawable(h[key]["value"] if key in h else r["eval"].get(key)) for r, h in zip(rows, held, strict=True)]


def key_label(rows: list[dict], key: str) -> str:
    held = next((s[key]["label"] for r in rows if key in (s := scores(r))), None)
    prefix = "global " if run_models(rows) != "global" else ""
    return MEANINGS.get(key, held or f"{prefix}{key}")


def draw_curves(rows: list[dict]) -> Figure:
    models = run_models(rows)
    rounds = [r["round"] for r in rows]
    first, second = curve_panels(rows)
    fig, (ax_score, ax_other) = plt.subplots(1, 2, figsize=(10, 4))
    for i, key in enumerate(first):
        ax_score.plot(rounds, series(rows, key), marker="o" if i == 0 else ".", linewidth=2.5 if i == 0 else 1.2,
                      label=key_label(rows, key) + (" (leads)" if i == 0 else ""))  # fmt: skip
    lead = key_label(rows, first[0]).split(" (")[0] if first else None
    ax_score.set(xlabel="round", ylabel=lead or "score",
                 title=f"{KINDS[models]}: {lead}" if lead else f"{KINDS[models]}: no score in any round")  # fmt: skip
    for key in second:
        ax_other.plot(rounds, series(rows, key), marker="o", label=key_label(rows, key))
    losses = any(k.endswith("loss") for k in second)
    what = "loss" if losses else ", ".join(key_label(rows, k).removeprefix("global ") for k in second)
    ax_other.set(xlabel="round", ylabel="test loss" if losses else "score",
                 title=f"Global model {what}" if second else "No loss in any round")  # fmt: skip
    for axes in (ax_score, ax_other):
        if axes.lines:
            axes.legend(fontsize="small")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(True, alpha=0.3)
    return fig


def round_axis(axes: Axes, rounds: list[int]) -> None:
    """A grid's columns (0, 1, …) labelled with the rounds they hold, whatever numbers those are."""
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: str(rounds[int(x)]) if x in range(len(rounds)) else ""))


def save(fig: Figure, png_path: Path) -> None:
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    save(draw_curves(read_rows(metrics_path)), png_path)
