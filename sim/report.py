"""``skyfed report PATH``: a run's plots beside its ``metrics.jsonl`` (or beside one metrics file), drawn for the
run's shape: a server's run (``curves.png``, ``agents.png``, ``privacy.png`` when it spent a privacy budget,
``buffer.png`` when its rounds folded late updates or lost some: asynchronous rounds), a peer run (one curve per
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


def plots_for(rows: list[dict], out: Path, regional: dict[str, list[dict]]) -> list[tuple[str, Callable[[], Figure]]]:
    """The PNGs a run of this shape gets, each with the drawing that makes it (``regional``: its regions' rows)."""
    if is_peer_run(rows):
        election = ElectedModel.read(out / "election.json", attackers_of(rows))
        return [("curves.png", lambda: draw_peer_curves(rows, election)),
                ("agents.png", lambda: draw_peer_rounds(rows))]
    plots = [("curves.png", lambda: draw_curves(rows)), ("agents.png", lambda: draw_agents(rows, regional))]
    plots += [("privacy.png", lambda: draw_privacy(rows))] if has_privacy(rows) else []
    return plots + ([("buffer.png", lambda: draw_buffer(rows))] if has_buffer(rows) else [])


def metrics_files(path: Path) -> list[tuple[Path, str, list[Path]]]:
    """What ``path`` asks to draw: ``(metrics file, prefix of its plots' names, its regions' metrics files)``. A
    folder: its ``metrics.jsonl``, with its regions', and each region's; a file: that one alone, its plots named
    after it unless it is a ``metrics.jsonl`` (an earlier run's file a server set aside, ``metrics-<UTC>.jsonl``,
    gets ``metrics-<UTC>.curves.png``, ...: the current run's plots stay)."""
    if path.is_file():
        return [(path, "" if path.name == "metrics.jsonl" else f"{path.stem}.", [])]
    regions = sorted(path.glob("regions/*/metrics.jsonl"))
    return [(path / "metrics.jsonl", "", regions), *((p, "", []) for p in regions)]


def write_report(path: Path, echo: Callable[[str], None] = print) -> list[Path]:
    """Every plot of the run in folder ``path`` and of its regions, or of the one metrics file ``path``
    (``metrics_files``); the PNGs written (none: no round to draw)."""
    written = []
    for metrics, prefix, regions in metrics_files(path):
        loaded = load_rows(metrics)
        for why, lines in sorted(loaded.skipped.items()):
            echo(f"skipped {lines} line(s) of {metrics}: {why}")
        if not loaded.rows:
            echo(f"{metrics} holds no round: nothing drawn")
            continue
        regional = {p.parent.name: load_rows(p).rows for p in regions}
        for name, draw in plots_for(loaded.rows, metrics.parent, regional):
            target = metrics.parent / f"{prefix}{name}"
            save(draw(), target)
            written.append(target)
            echo(f"wrote {target}")
    return written
