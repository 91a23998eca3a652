"""A server whose state went back in time catches up with its fleet by itself.

Agents order round tasks by (round, attempt) within a server run (``RoundTask.is_newer_than``) and refuse
an older one as ``older-than-held``, which is what keeps a replayed old task from stalling them. So a
server that resumes from a state older than what it already published — a state directory restored
from a backup, or one that a second server on the same folder overwrote (``common.lock`` now refuses
that) — would ask for rounds its agents hold as old, forever.

The agents say what they hold in their signed status (``run_id``, ``round``, ``version``). When enough
of them report a round of this run beyond the server's own, the server jumps past it: its next round and
model version go one past what they hold, and every agent accepts the next task and model as newer.

Why this cannot be abused: a status is signed by an enrolled agent, but an agent gone rogue could claim
any round. The jump goes only as far as the ``agreeing``-th highest claim (``max(2, rounds.quorum)``
agents, or every enrolled agent when there are fewer): fewer agents than that, whatever they claim,
cannot move the server at all, and the claims of a few cannot push it past what that many agents
agree they hold. A jump only skips round numbers; it changes no model, and it is logged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from protocol.messages import AgentStatus


@dataclass(frozen=True)
class CatchUp:
    next_round: int  # the round the server opens next
    version: int  # the model version it publishes its (unchanged) model as
    agents: list[str]  # the agents ahead of it
    held_round: int  # the round they agree they hold

    def describe(self, server_round: int, server_version: int) -> str:
        return (f"state behind the fleet: agents {','.join(self.agents)} hold round {self.held_round} of this run, "
                f"this state only round {server_round} (restored from a backup, or written by another server on "
                f"this state_dir?); jumping to round {self.next_round} and model version {self.version} (was "
                f"{server_version}) so that they accept its tasks again")  # fmt: skip


def agreeing_agents(quorum: int, enrolled: int) -> int:
    """How many agents must report a newer round before the server believes it (at least 1)."""
    return max(1, min(max(2, quorum), enrolled))


def catch_up(statuses: Iterable[AgentStatus], *, run_id: str, held_round: int, version: int,
             agreeing: int) -> CatchUp | None:  # fmt: skip
    """What to jump to when ``agreeing`` agents hold a round of ``run_id`` above ``held_round`` (the server's
    open round, or its last one), else None."""
    ahead = [s for s in statuses if s.state != "offline" and s.run_id == run_id and s.round > held_round]
    if len(ahead) < agreeing:
        return None
    rounds = sorted((s.round for s in ahead), reverse=True)
    versions = sorted((s.version for s in ahead), reverse=True)
    agreed_round, agreed_version = rounds[agreeing - 1], versions[agreeing - 1]
    return CatchUp(agreed_round + 1, max(version, agreed_version + 1), sorted(s.agent for s in ahead), agreed_round)
