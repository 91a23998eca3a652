"""``buffer.png``: what each round's model was made of, for runs whose rounds fold late updates or lose some
(asynchronous rounds' buffers, ``rounds.mode = "async"``; a synchronous run's late and stale refusals): the updates
folded on time and late, the trained updates lost (refused for their timing), and the buffer's staleness."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from sim.plots import plt
from sim.report_rows import drawable


def _field(row: dict, key: str) -> dict:
    value = row.get(key)
    return value if isinstance(value, dict) else {}


def has_buffer(rows: list[dict]) -> bool:
    return any(_field(r, "buffer") or _field(r, "wasted") for r in rows)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def draw_buffer(rows: list[dict]) -> Figure:
    rounds = [r["round"] for r in rows]
    buffers = [_field(r, "buffer") for r in rows]
    late = [_count(b.get("late")) for b in buffers]
    fresh = [max(0, _count(b.get("updates")) - n) if b else len(r.get("accepted") or []) for b, n, r in
             zip(buffers, late, rows, strict=True)]  # fmt: skip
    lost = [sum(_count(v) for v in _field(r, "wasted").values()) for r in rows]
    fig, (counts, ages) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    counts.bar(rounds, fresh, label="on time", color="#2da44e")
    counts.bar(rounds, late, bottom=fresh, label="late (trained from an older model)", color="#bf8700")
    counts.bar(rounds, [-n for n in lost], label="lost (refused late, stale, one per buffer)", color="#cf222e")
    counts.axhline(0, color="black", linewidth=0.5)
    counts.set(ylabel="updates", title="Updates folded into each model version, and lost")
    counts.legend(fontsize="x-small")
    if any(buffers):
        ages.plot(rounds, [drawable(b.get("staleness_mean")) for b in buffers], marker="o", label="mean")
        ages.plot(rounds, [drawable(b.get("staleness_max")) for b in buffers], marker=".", linestyle="--", label="max")
        ages.legend(fontsize="x-small")
    ages.set(xlabel="round (one buffer, one model version)", ylabel="versions behind",
             title="Staleness of the folded updates" if any(buffers) else "Staleness: synchronous rounds")
    for ax in (counts, ages):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig
