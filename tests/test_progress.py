"""Live progress of ``skyfed sim`` (a line per agent, or a summary past 20 agents) and of an experiment grid."""

from __future__ import annotations

from protocol.messages import AgentStatus, Gate
from sim.experiment import grid_progress
from sim.progress import PER_AGENT_LINES, SUMMARY_EVERY_S, LineProgress


def _status(agent: str, state: str, round_number: int) -> AgentStatus:
    return AgentStatus(agent=agent, state=state, round=round_number, run_id="r", task_version=round_number,
                       receipt="", samples=10, version=round_number, updated_at=0.0,
                       gate=Gate(ok=True, reasons=[]))  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_per_agent_when_it_starts_and_finishes_training_and_none_for_repeats():
    lines: list[str] = []
    clock = Clock()
    progress = LineProgress(2, lines.append, clock)
    progress.status("agent-01", _status("agent-01", "idle", 1))
    progress.status("agent-01", _status("agent-01", "training", 1))
    progress.status("agent-01", _status("agent-01", "training", 1))  # a periodic status: no new line
    clock.now += 2.5
    progress.status("agent-01", _status("agent-01", "uploading", 1))
    progress.status("agent-01", _status("agent-01", "done", 1))  # finished once, said once
    assert lines == ["  round   1  agent-01 training", "  round   1  agent-01 trained in 2.5 s"]


def test_past_20_agents_one_summary_line_per_interval_instead():
    lines: list[str] = []
    clock = Clock()
    agents = PER_AGENT_LINES + 10
    progress = LineProgress(agents, lines.append, clock)
    for k in range(agents):
        progress.status(f"a{k}", _status(f"a{k}", "training", 3))
    for k in range(7):
        progress.status(f"a{k}", _status(f"a{k}", "done", 3))
    assert lines == []  # nothing per agent, and the interval has not passed
    clock.now += SUMMARY_EVERY_S
    progress.status("a7", _status("a7", "done", 3))
    assert lines == [f"  round   3  8 of {agents} agents trained, {agents - 8} training"]


def test_the_grid_says_which_run_of_how_many_and_when_it_will_end():
    assert grid_progress(0, 4, [], "iid / fedavg / seed 0") == "[1/4] iid / fedavg / seed 0: ETA after the first run"
    assert grid_progress(2, 4, [30.0, 50.0], "x") == "[3/4] x: ETA 1 min 20 s"  # 40 s a run, 2 runs left
    assert grid_progress(3, 4, [12.0], "x") == "[4/4] x: ETA 12 s"  # resumed: one run done here, one left
