"""Whether a round task is one this edge agent may adopt: signed by its server, of its federation, and not
older than the task it holds (a replayed old task must not stall it). Pure, so the daemon alone decides what
a refusal costs (a throttled log line) and when a task's time is judged (``agent.clock``)."""

from __future__ import annotations

from protocol.messages import MessageError, RoundTask
from security.keys import PublicIdentity
from security.signing import InvalidDocument, verify_document


class TaskRefused(Exception):
    """Its text is the log line; ``key`` what the daemon throttles it by."""

    def __init__(self, key: str, message: str, *args: object) -> None:
        super().__init__(message % args)
        self.key = key


def checked_task(document: object, server: PublicIdentity, federation: str, held: RoundTask | None) -> RoundTask:
    """The task ``document`` carries, if the agent may adopt it over ``held``; else ``TaskRefused``."""
    try:
        task = RoundTask.from_dict(verify_document(document, server))
    except (InvalidDocument, MessageError) as exc:
        raise TaskRefused("task-invalid", "round task rejected reason=%s", getattr(exc, "reason", exc)) from None
    if task.federation != federation:
        raise TaskRefused("task-federation", "round task rejected reason=wrong-federation federation=%s",
                          task.federation)  # fmt: skip
    if held is not None and held != task and not task.is_newer_than(held):
        raise TaskRefused("task-stale", "round task ignored reason=older-than-held round=%d attempt=%d",
                          task.round, task.attempt)  # fmt: skip
    return task
