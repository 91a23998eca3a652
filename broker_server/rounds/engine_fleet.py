"""What the fleet does to the open round that the engine did not plan: an agent that says it will not
deliver (``gave_up``), an agent revoked mid-round (``revoke``), and agents that prove they hold newer
rounds than this state (``jump``, ``broker_server.rounds.catch_up``). ``RoundEngine.fleet``; each change ends in a
checkpoint, inside the daemon's ``state.durably`` (``broker_server.rounds.disk``).
"""

from __future__ import annotations

from collections.abc import Callable

from broker_server.rounds.engine_state import EngineState


class FleetEvents:
    """Changes the engine's ``state``; ``reject`` lists a refusal in the open round's metrics (``RoundEngine``)."""

    def __init__(self, state: EngineState, *, reject: Callable[[str, str], None]) -> None:
        self.state, self.reject = state, reject
        self.revoked_between_rounds: list[str] = []  # named in the next round's task, so they hear of it

    def take_revoked(self) -> list[str]:
        """The agents revoked since the last round opened, for the next round's task (and forgotten here)."""
        revoked, self.revoked_between_rounds = self.revoked_between_rounds, []
        return revoked

    def gave_up(self, agent: str, round_number: int, why: str, now: float) -> bool:
        """A pending agent that will not deliver in round ``round_number`` (its signed status says its training
        failed, or its whole transfer was refused): not waited for, backed off. False if not pending there."""
        rs = self.state.round_state
        if rs is None or rs.round != round_number or agent not in rs.pending:
            return False
        rs.missed.append(agent)  # excused: a stand-in may replace it at the deadline, a late update is welcome
        self.state.health.back_off([agent], round_number, why, now, timed=False)  # not waited for: cost no deadline
        self.state.checkpoint()
        return True

    def revoke(self, agent: str) -> bool:
        """``agent``'s enrolment was withdrawn: its part in the open round ends now — its update, if one was
        accepted, is dropped, it is no longer waited for, the round's metrics list it as missed with a
        ``revoked`` rejection, and the round's task names it (``revoked``) so it stops. Returns whether
        the open round changed (its task must be issued again)."""
        rs = self.state.round_state
        if rs is None:
            self.revoked_between_rounds.append(agent)
            return False
        sent = any(u.agent == agent for u in rs.updates)  # its own update, or a late one folded in
        if agent not in rs.selected and not sent:
            return False
        if sent:  # out of the average
            rs.updates = [u for u in rs.updates if u.agent != agent]
            self.state.unfold()
        rs.missed.append(agent)
        rs.revoked.append(agent)
        self.reject(agent, "revoked: its enrolment was withdrawn during the round; its part ended")
        self.state.checkpoint()
        return True

    def jump(self, next_round: int, version: int) -> None:
        """Agents hold newer rounds of this run than this state (``broker_server.rounds.catch_up``): the open round,
        if any, is dropped (they would refuse its task), and the next round and model version go past theirs."""
        state = self.state
        state.round_state = None
        state.next_round, state.version = max(state.next_round, next_round), max(state.version, version)
        state.checkpoint()
