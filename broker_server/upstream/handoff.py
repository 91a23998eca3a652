"""A region's aggregator and the root's rounds (``[upstream]``, docs/architecture.md "Regions").

A region takes part in its root's federation as one participant. The participant's half (``region.daemon``:
an edge agent whose trainer is this region) receives the root's round and model, and asks
``UpstreamHandoff.ask``; the aggregator's loop takes the request (``pending``), makes the root's model its own
global model, runs one round with its agents, and hands the aggregate back (``deliver``), which the
participant's half sends to the root as its update: a delta from the root's model, weighted by the region's
total weight. The two halves run on two threads of one process; this object is all they share.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field

from flcore.rounds import UpdateRecord
from models.weights import NamedArrays
from protocol.scores import personal_score


@dataclass(frozen=True)
class RootRound:
    """A round of the root that waits for this region: the model the region's round starts from."""

    round: int
    attempt: int
    model: NamedArrays
    deadline: float  # wall-clock time by which the root wants the region's update


@dataclass(frozen=True)
class RegionResult:
    """What the region's round for root round ``round`` produced: its aggregate and total weight, or why not."""

    round: int
    model: NamedArrays | None  # None: the region's round did not commit (``reason``)
    weight: int = 0
    loss: float = math.nan
    evaluation: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    personal: dict = field(default_factory=dict)  # the regional round's ``personal`` (its agents' C-SPE reports)

    @classmethod
    def of_round(cls, root_round: int, model: NamedArrays, accepted: list[UpdateRecord],
                 evaluation: dict[str, float], sample_cap: float | None = None,
                 personal: dict | None = None) -> RegionResult:  # fmt: skip
        """The committed aggregate of ``accepted`` updates, weighted by their total weight as the region's bounds
        counted it (each claim at most ``sample_cap``: an agent's inflated claim does not inflate its region's
        weight at the root), with their weighted loss: each loss times its share of the weight, so the mean of
        finite losses stays finite (an agent's loss need only be finite; 1e308 times its weight was infinite, and
        the root refused the region's whole aggregate for it)."""
        weights = [min(u.samples, sample_cap) if sample_cap is not None else u.samples for u in accepted]
        weight = int(sum(weights))
        if weight <= 0:
            return cls(root_round, None, reason="no update with a positive weight was averaged")
        loss = sum(w / weight * u.loss for w, u in zip(weights, accepted, strict=True))
        loss = max(-sys.float_info.max, min(loss, sys.float_info.max))  # shares adding up to a hair over 1
        return cls(root_round, model, weight, loss, dict(evaluation), personal=dict(personal or {}))

    def reported(self, key: str) -> dict[str, float]:
        """The mean C-SPE its agents reported (``c_spe`` of the root's model they started from, ``trained_c_spe`` of
        the models they trained), as the region's own C-SPE report to the root; {} when none (a detector's round,
        or central DP in the region, which publishes no C-SPE)."""
        value = personal_score(self.personal, key)
        return {"accuracy": value} if isinstance(value, float) else {}


class RegionalRoundFailed(Exception):
    """The region has no aggregate for the root's round: the participant's half reports its training failed."""


class UpstreamHandoff:
    """The one root round this region works on, and its result, between the two threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._request: RootRound | None = None
        self._begun = False
        self._result: RegionResult | None = None
        self._closed = False

    def ask(self, request: RootRound, timeout_s: float) -> RegionResult:
        """The participant's thread: the region's result for ``request``, once its round closes. A newer
        request (the root moved on), ``close`` or the timeout end the wait with ``RegionalRoundFailed``."""
        with self._cond:
            self._request, self._begun, self._result = request, False, None
            self._cond.notify_all()
            end = time.monotonic() + timeout_s
            while self._result is None or self._result.round != request.round:
                left = end - time.monotonic()
                if self._closed or self._request is not request or left <= 0:
                    why = ("the region stops" if self._closed else "the root asked for a newer round"
                           if self._request is not request else "the root's deadline passed")  # fmt: skip
                    if self._request is request:  # nobody waits for it any more: no regional round for it
                        self._request = None
                    raise RegionalRoundFailed(f"no regional aggregate for root round {request.round}: {why}")
                self._cond.wait(left)
            result = self._result
        if result.model is None:
            raise RegionalRoundFailed(f"the regional round for root round {request.round} did not commit: "
                                      f"{result.reason}")  # fmt: skip
        return result

    def pending(self) -> RootRound | None:
        """The aggregator's loop: the root round that waits for a regional round to begin, if any."""
        with self._cond:
            return None if self._begun or self._closed else self._request

    def begun(self, request: RootRound) -> None:
        """The regional round for ``request`` is open: it is no longer pending."""
        with self._cond:
            if self._request is request:
                self._begun = True

    def deliver(self, result: RegionResult) -> bool:
        """The regional round for ``result.round`` closed; False when the root no longer waits for it."""
        with self._cond:
            if self._request is None or self._request.round != result.round or self._closed:
                return False
            self._result, self._begun = result, True  # answered: no longer pending either way
            self._cond.notify_all()
            return True

    def close(self) -> None:
        """The process stops: a waiting participant's thread gives up at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
