"""The server's retained status says when its run is over (``finished``, or ``budget_exhausted``): the agent
notices, says so once, and shows it in its status instead of waiting for rounds that will not come.

Server status is not signed; with the provisioned ACL only the server writes it. A forged "finished" on an
open broker changes what the agent says, never what it does: a new signed round task is trained as always.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import MessageError, ServerStatus

ENDED = ("finished", "budget_exhausted")


@dataclass
class RunEnd:
    federation: str
    ended: ServerStatus | None = None

    def note(self, payload: bytes) -> bool:
        """Fold in one server status; True when it is the news that the run ended."""
        try:
            status = ServerStatus.from_json(payload) if payload else None
        except MessageError:
            return False
        if status is None or status.federation != self.federation:
            return False
        was, self.ended = self.ended, status if status.state in ENDED else None
        return self.ended is not None and was is None

    def detail(self) -> str:
        s = self.ended
        if s is None:
            return ""
        why = ": the privacy budget is spent" if s.state == "budget_exhausted" else ""
        return (f"the server's run is over after round {s.round}{why} (final model v{s.model_version}); "
                "nothing to train until the server starts a new run")  # fmt: skip
