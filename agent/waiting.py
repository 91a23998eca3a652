"""What an idle agent waits for, in words an operator can act on: its status ``detail`` and its log."""

from __future__ import annotations

from protocol.messages import RoundTask
from protocol.topics import Topics

STUCK_LOG_S = 60.0  # connected this long without the group key: say why in the agent's own log


class StuckNotice:
    """Someone watching a device's journal learns, once, why it never trains (not only the server)."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._said = False

    def due(self, stuck: bool, now: float) -> float | None:
        """How long it has been stuck, the first time that passes ``STUCK_LOG_S``; else None."""
        if not stuck:
            self._since = None
            return None
        self._since = self._since or now
        if now - self._since >= STUCK_LOG_S and not self._said:
            self._said = True
            return now - self._since
        return None


def waiting_for(
    *, agent: str, topics: Topics, key_mismatch: bool, has_group_key: bool, task: RoundTask | None, state: str
) -> str:
    """The first thing missing, with how to fix it ('' when nothing is missing)."""
    if key_mismatch:
        return (
            "the group key the server sealed for this agent does not open with this agent's key: its key "
            f"changed after it was enrolled. Re-enrol this agent: skyfed keys enroll {agent}.pub "
            "--enrolled <server's keys.enrolled> (the running server picks it up)"
        )
    if not has_group_key:
        return (
            "waiting for the group key, which the server sends to enrolled agents once it sees their signed "
            f"status; if this lasts, {agent} is not enrolled there, or was enrolled with a key it no longer "
            f"has: enrol or re-enrol this agent (skyfed keys enroll {agent}.pub --enrolled <server's "
            "keys.enrolled>; the running server picks it up); or the server is not running, or runs another "
            f"federation than this agent's {topics.federation!r}; or, with TLS and the per-agent ACL, "
            "this agent's certificate CN is not its id (the broker then drops its messages)"
        )
    if task is None:
        return f"waiting for a round task on {topics.round}"
    if state == "waiting-model":
        start = task.start_of(agent)
        if start.source != "global":
            return f"waiting for its start model {start.sha256[:12]} ({start.source}), which the server sends"
        return f"waiting for model version {task.model_version} on the broker"
    if state == "idle" and agent not in task.selected:
        return f"not selected for round {task.round}"
    return ""
