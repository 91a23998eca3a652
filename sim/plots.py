"""Plots of a run's ``metrics.jsonl`` (accuracy and loss per round), written as PNG."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: drones and CI have no display
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
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
