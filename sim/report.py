"""``skyfed report DIR``: a run's plots beside its ``metrics.jsonl``, drawn for the run's shape: a server's run
(``curves.png``, ``agents.png``, ``privacy.png`` when it spent a privacy budget, ``buffer.png`` when its rounds
folded late updates or lost some: asynchronous rounds), a peer run (one curve per
peer, the elected model marked), and at a region run's root also each region's, in ``regions/<region>/``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure

from sim.plot_agents import draw_agents
from sim.plot_buffer import draw_buffer, has_buffer
from sim.plot_peers import ElectedModel, attackers_of, draw_peer_curves, draw_peer_rounds
from sim.plot_privacy import draw_privacy, has_privacy
from sim.plots import draw_curves, save
from sim.report_rows import is_peer_run, load_rows


def plots_for(rows: list[dict], out: Path) -> list[tuple[str, Callable[[], Figure]]]:
    """The PNGs a run of this shape gets, each with the drawing that makes it."""
    if is_peer_run(rows):
        election = ElectedModel.read(out / "election.json", attackers_of(rows))
        return [("curves.png", lambda: draw_peer_curves(rows, election)),
                ("agents.png", lambda: draw_peer_rounds(rows))]
    regional = {p.parent.name: load_rows(p).rows for p in sorted(out.glob("regions/*/metrics.jsonl"))}
    plots = [("curves.png", lambda: draw_curves(rows)), ("agents.png", lambda: draw_agents(rows, regional))]
    plots += [("privacy.png", lambda: draw_privacy(rows))] if has_privacy(rows) else []
    return plots + ([("buffer.png", lambda: draw_buffer(rows))] if has_buffer(rows) else [])


def write_report(out: Path, echo: Callable[[str], None] = print) -> list[Path]:
    """Every plot of the run in ``out`` and of its regions; the PNGs written (none: the run holds no round)."""
    written = []
    for folder in (out, *sorted(p.parent for p in out.glob("regions/*/metrics.jsonl"))):
        loaded = load_rows(folder / "metrics.jsonl")
        for why, lines in sorted(loaded.skipped.items()):
            echo(f"skipped {lines} line(s) of {folder / 'metrics.jsonl'}: {why}")
        if not loaded.rows:
            echo(f"{folder / 'metrics.jsonl'} holds no round: nothing drawn")
            continue
        for name, draw in plots_for(loaded.rows, folder):
            save(draw(), folder / name)
            written.append(folder / name)
            echo(f"wrote {folder / name}")
    return written
