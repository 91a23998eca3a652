"""The questions the rest of SkyFed asks a strategy about what it can do, answered from what it declares
(``Strategy``'s capability attributes; docs/architecture.md, "Plug-ins"), never from its name: a new
strategy is checked by privacy, peers and the task like the others, with no list to extend. The
capability table of docs/strategies.md is generated here too (a test keeps the doc equal to it).
"""

from __future__ import annotations

from flcore.strategies import STRATEGIES
from flcore.strategies.base import Strategy

PROBE_UPDATES = 10  # the round size a configuration check asks ``dp_sensitivity`` about
NO_BOUND = "the model must come from clipped updates whose aggregate has a bounded sensitivity"


def has_dp_bound(strategy: Strategy, clip: float) -> bool:
    """Whether differential privacy can calibrate its noise to ``strategy`` (its ``dp_sensitivity`` has a bound)."""
    return strategy.dp_sensitivity(PROBE_UPDATES, clip) is not None


def private_choices() -> str:
    """What ``[privacy]`` runs with default options, for its refusals (the swapping ones aside: their own rules)."""
    bounded = [cls for _, cls in STRATEGIES.items() if not cls.swaps and has_dp_bound(cls(), 1.0)]
    weighted = ", ".join(cls.name for cls in bounded if cls.weighted)
    robust = ", ".join(cls.name for cls in bounded if not cls.weighted)
    return f'{weighted} with weighting = "uniform" (or "samples" with privacy.weight_cap), or {robust}'


def refusal(declared: bool | str, where: str) -> str:
    """Why not, from a ``bool | str`` capability (``peers``, ``local_dp``), or "": True, it can; a text says why
    not; False, it cannot (``where``: "between peers", say)."""
    return "" if declared is True else declared or f"it declares that it does not work {where}"


def task_refusal(kind: type[Strategy], task: str) -> str:
    """Why ``kind`` cannot run with a ``task`` model (``models.tasks``: classify, detect), or ""."""
    if task in kind.tasks:
        return ""
    why = kind.why_not_tasks or f"is for {' and '.join(sorted(kind.tasks))} models only"
    fits = ", ".join(STRATEGIES.where(lambda cls: task in cls.tasks))
    return f"strategy {kind.name} {why}: choose one of {fits} for a {task} model"


def averaging_choices() -> str:
    """The strategies that publish one model for everyone (no kept per-agent models), for config errors."""
    return ", ".join(STRATEGIES.where(lambda cls: not cls.keeps_models))


def _privacy(kind: type[Strategy]) -> str:
    if not has_dp_bound(kind(), 1.0):
        return "no"
    if kind.swaps:
        return "yes: each swapped model noised, averages a uniform mean"
    return "yes: weighted (samples need `weight_cap`)" if kind.weighted else "yes: unweighted, noise to its bound"


def _yes(can: bool) -> str:
    return "yes" if can else "no"


def capability_table() -> str:
    """The Markdown table of every registered strategy's declared capabilities (docs/strategies.md)."""
    rows = ["| `name` | under `[privacy]` | between peers | tasks | keeps models | judged by | local DP-SGD |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, kind in STRATEGIES.items():
        cells = (f"`{name}`", _privacy(kind), _yes(kind.peers is True), ", ".join(sorted(kind.tasks)),
                 _yes(kind.keeps_models), kind.models, _yes(kind.local_dp is True))  # fmt: skip
        rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows) + "\n"
