"""Live training progress while ``skyfed sim``/``demo`` run, from the agents' retained status messages:
a line per agent as it starts and finishes training (plain text, for a pipe or a log), or, on a terminal,
a bar per round of the agents that finished it. Past ``PER_AGENT_LINES`` agents the plain form prints one
summary line per round every ``SUMMARY_EVERY_S`` instead (1,000 agents would print 2,000 lines a round).
Statuses are read as claimed (the sim holds no keys it would check them with); they only feed this display."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.messages import AgentStatus, MessageError
from protocol.topics import Topics

PER_AGENT_LINES = 20
SUMMARY_EVERY_S = 5.0
FINISHED = frozenset({"uploading", "done"})  # the agent's states once its round's training is over


@dataclass
class AgentRounds:
    """Per agent, the round it trains and since when; per round, the agents that finished it."""

    training: dict[str, tuple[int, float]] = field(default_factory=dict)  # agent -> (round, since)
    finished: dict[int, set[str]] = field(default_factory=dict)

    def note(self, agent: str, status: AgentStatus, now: float) -> tuple[str, int, float] | None:
        """Fold in one status; ``("started", round, 0)`` or ``("finished", round, seconds)`` when it changed."""
        held = self.training.get(agent)
        if status.state == "training" and (held is None or held[0] != status.round):
            self.training[agent] = (status.round, now)
            return "started", status.round, 0.0
        if held is not None and status.state in FINISHED:
            del self.training[agent]
            self.finished.setdefault(held[0], set()).add(agent)
            return "finished", held[0], now - held[1]
        return None


class LineProgress:
    """Plain lines through ``echo``."""

    def __init__(self, agents: int, echo: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.agents, self.echo, self.clock = agents, echo, clock
        self.rounds = AgentRounds()
        self._summarised = clock()

    def status(self, agent: str, status: AgentStatus) -> None:
        now = self.clock()
        change = self.rounds.note(agent, status, now)
        if change is not None and self.agents <= PER_AGENT_LINES:
            kind, number, seconds = change
            self.echo(f"  round {number:3d}  {agent} training" if kind == "started"
                      else f"  round {number:3d}  {agent} trained in {seconds:.1f} s")  # fmt: skip
        elif self.agents > PER_AGENT_LINES and self.rounds.training and now - self._summarised >= SUMMARY_EVERY_S:
            self._summarised = now
            number = max(r for r, _ in self.rounds.training.values())
            done = len(self.rounds.finished.get(number, ()))
            self.echo(f"  round {number:3d}  {done} of {self.agents} agents trained, "
                      f"{len(self.rounds.training)} training")  # fmt: skip

    def close(self) -> None:
        """Nothing held open."""


class BarProgress:
    """A ``rich`` bar per round on a terminal: the agents that finished training it, of all the agents."""

    def __init__(self, agents: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.agents = agents
        self.rounds = AgentRounds()
        self.bars = Progress(TextColumn("round {task.fields[round]:>3}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("agents trained"), TimeElapsedColumn(), transient=False)  # fmt: skip
        self.tasks: dict[int, object] = {}
        self.bars.start()

    def status(self, agent: str, status: AgentStatus) -> None:
        change = self.rounds.note(agent, status, time.monotonic())
        if change is None:
            return
        number = change[1]
        if number not in self.tasks:
            self.tasks[number] = self.bars.add_task("", total=self.agents, round=number)
        self.bars.update(self.tasks[number], completed=len(self.rounds.finished.get(number, ())))

    def close(self) -> None:
        self.bars.stop()


def feed(progress: LineProgress | BarProgress, topics: Topics, topic: str, payload: bytes) -> bool:
    """Hand ``progress`` an agent status received on ``topic``; False when it is not one."""
    agent = topics.agent_of(topic)
    if not agent or topic != topics.agent_status(agent) or not payload:
        return False
    try:
        progress.status(agent, AgentStatus.from_signed_json(payload))
    except MessageError:
        pass  # a garbled status changes no display
    return True
