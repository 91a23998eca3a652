"""Getting the current model to an agent that waits for it, without flooding everyone.

The global model is published once per version, retained, sealed under the group key. An agent whose
signed status keeps saying ``waiting-model`` for the round it was asked to train (its copy was lost, a
partial transfer expired) gets the model again *on its own inbox*, sealed to it alone, at a bounded
rate: after ``MODEL_STALL_S`` of waiting, then at doubling intervals while it keeps waiting (at most
``MAX_RESEND_INTERVAL_S`` apart), and never more than ``MAX_RESENDS_PER_WINDOW`` resends a
``RESEND_WINDOW_S`` across all agents. One agent that says it waits forever so costs one model a few
minutes, not the whole fleet a model every 15 s.

The retained copy itself is re-published only when it is actually gone or replaced: the server reads
its own retained chunks back (``RetainedModel``, subscribed to ``model/+/+``) and compares each with
what it published; an empty or different payload under the current version marks it damaged.
Pure bookkeeping with an injected clock: the daemon does the sending.
"""

from __future__ import annotations

import hashlib
from collections import deque

MODEL_STALL_S = 15.0  # an agent waiting this long for the current model gets it sent to its inbox
MAX_RESEND_INTERVAL_S = 240.0  # one agent gets the model at most this often while it keeps waiting
RESEND_WINDOW_S = 60.0
MAX_RESENDS_PER_WINDOW = 4  # resends to all agents together within a window


class ModelWaits:
    """Which asked agents wait for the model, and which of them may be sent it now."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}  # agent -> when it was first seen waiting
        self.interval: dict[str, float] = {}  # agent -> how long until it may get the model again
        self.sent: deque[float] = deque()  # times of recent resends, all agents

    def note(self, agent: str, waiting: bool, now: float) -> None:
        """An asked agent's latest status: waiting for the model or not. Its pace (``interval``) lasts while
        it is asked, so flipping its status between waiting and not does not start it over."""
        if waiting:
            self.since.setdefault(agent, now)
        else:
            self.since.pop(agent, None)

    def due(self, now: float, asked: list[str]) -> list[str]:
        """Agents to send the model now, of those still ``asked`` (pending); each is counted as sent."""
        for agent in (set(self.since) | set(self.interval)) - set(asked):  # the round moved on, or it delivered
            self.since.pop(agent, None)
            self.interval.pop(agent, None)
        while self.sent and now - self.sent[0] >= RESEND_WINDOW_S:
            self.sent.popleft()
        out = []
        for agent, since in sorted(self.since.items(), key=lambda item: item[1]):
            if len(self.sent) >= MAX_RESENDS_PER_WINDOW:
                break
            wait = self.interval.get(agent, MODEL_STALL_S)
            if now - since >= wait:
                out.append(agent)
                self.sent.append(now)
                self.since[agent] = now
                self.interval[agent] = min(2 * wait, MAX_RESEND_INTERVAL_S)
        return out


class RetainedModel:
    """Whether the broker still holds the current model's chunks exactly as published."""

    def __init__(self) -> None:
        self.version = 0
        self.digests: list[bytes] = []
        self.damaged: set[int] = set()  # chunk indexes last seen empty or different

    def published(self, version: int, chunks: list[bytearray]) -> None:
        self.version, self.damaged = version, set()
        self.digests = [hashlib.sha256(chunk).digest() for chunk in chunks]

    def observe(self, version: int, index: str, payload: bytes) -> None:
        """A retained chunk read back (ours, or someone else's under our topic)."""
        if version != self.version or not index.isdigit() or int(index) >= len(self.digests):
            return
        if hashlib.sha256(payload).digest() == self.digests[int(index)]:
            self.damaged.discard(int(index))
        else:
            self.damaged.add(int(index))
