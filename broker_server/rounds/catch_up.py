"""A server whose state went back in time catches up with its fleet by itself.

Agents order round tasks by (round, attempt) within a server run (``RoundTask.is_newer_than``) and refuse
an older one as ``older-than-held``, which is what keeps a replayed old task from stalling them. So a
server that resumes from a state older than what it already published — a state directory restored
from a backup, or one that a second server on the same folder overwrote (``common.lock`` now refuses
that) — would ask for rounds its agents hold as old, forever.

Each task carries the server's ``receipt``: its signature of (federation, run id, round, model version).
Agents echo the receipt of the task they hold in their signed status (``run_id``, ``round``,
``task_version``, ``receipt``). When an agent shows a receipt of this run for a round beyond the
server's own, the server jumps past it: its next round goes one past that round, and its model version
two past that task's (the round's commit published one more), so every agent takes the next task and
model as newer.

Why a rogue agent cannot abuse it: a claimed round counts only with the server's own signature over it,
which the server made only for rounds it really issued; an agent can at most replay a genuine receipt,
and jumping to a round the server did issue is the point. A jump only skips round numbers; it changes no
model, and it is logged. A server whose identity key was re-made cannot check old receipts, and does not
jump.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from protocol.messages import AgentStatus


@dataclass(frozen=True)
class CatchUp:
    next_round: int  # the round the server opens next
    version: int  # the model version it publishes its (unchanged) model as
    agents: list[str]  # the agents ahead of it
    held_round: int  # the newest round they prove they hold

    def describe(self, server_round: int, server_version: int) -> str:
        return (f"state behind the fleet: agents {','.join(self.agents)} hold round {self.held_round} of this run, "
                f"this state only round {server_round} (restored from a backup, or written by another server on "
                f"this state_dir?); jumping to round {self.next_round} and model version {self.version} (was "
                f"{server_version}) so that they accept its tasks again")  # fmt: skip


def catch_up(statuses: Iterable[AgentStatus], *, run_id: str, held_round: int, version: int,
             proven: Callable[[AgentStatus], bool]) -> CatchUp | None:  # fmt: skip
    """What to jump to when agents hold a round of ``run_id`` above ``held_round`` (the server's open round,
    or its last one) and ``proven`` says the server's receipt for it verifies; else None."""
    ahead = [s for s in statuses if s.state != "offline" and s.run_id == run_id and s.round > held_round]
    ahead = [s for s in ahead if proven(s)]
    if not ahead:
        return None
    newest = max(ahead, key=lambda s: (s.round, s.task_version))
    agents = sorted(s.agent for s in ahead)
    return CatchUp(newest.round + 1, max(version, newest.task_version + 2), agents, newest.round)
