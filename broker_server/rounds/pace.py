"""How fast each agent delivers, as the server saw it: seconds per unit of local work.

Measured from the round's start to the agent's accepted update (download, training and upload, on
the server's own clock; nothing the agent claims), divided by the share of the round's local work
the agent was asked for (a partial-work recipe's share), so the figure does not move when a strategy
changes that share. An exponential moving average (``SMOOTHING``) lets a device that slows down or
speeds up be followed within a few rounds. Strategies read it in ``configure_train`` (FedProx's partial
work for slow devices). Pure bookkeeping; the engine keeps it in the checkpoint.
"""

from __future__ import annotations

SMOOTHING = 0.5  # weight of the newest observation


class PaceBook:
    def __init__(self, seconds_per_work: dict[str, float] | None = None) -> None:
        self.seconds_per_work = seconds_per_work or {}

    def observe(self, agent: str, seconds: float, work: float) -> None:
        """``agent`` delivered ``work`` (a share in (0, 1]) ``seconds`` after the round started."""
        pace = max(seconds, 0.0) / work
        previous = self.seconds_per_work.get(agent)
        self.seconds_per_work[agent] = pace if previous is None else SMOOTHING * pace + (1 - SMOOTHING) * previous

    def of(self, agents: list[str]) -> dict[str, float]:
        """Seconds per unit of work for those of ``agents`` that delivered before."""
        return {a: self.seconds_per_work[a] for a in agents if a in self.seconds_per_work}

    def to_dict(self) -> dict[str, float]:
        return dict(self.seconds_per_work)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> PaceBook:
        return cls(dict(data))
