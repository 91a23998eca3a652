"""The round engine: selection, quorum and deadline, as pure bookkeeping (no I/O, injectable clock).

docs/architecture.md, round lifecycle: select agents (fraction, minimum), announce, accept updates, and
close when every selected agent has reported (an agent whose authenticated update was refused has
reported: it has no other one to send), or when the deadline passed with the quorum met. A deadline
without quorum re-announces the same round (``attempt`` + 1); ``replace_missing`` first lets eligible
agents that were not selected stand in for the ones that missed it (they are excused: no longer waited
for, though a late update of theirs is still accepted). Selection happens before any strategy sees an
update, so stand-ins are simply more contributors to whatever the strategy does.
The daemon turns these decisions into MQTT messages; this module can be tested without a broker.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields, replace

from flcore.staleness import DEFAULT_STALENESS, Staleness


@dataclass(frozen=True)
class RoundRules:
    """From ``[rounds]`` in server.toml."""

    fraction: float = 1.0
    min_agents: int = 2
    quorum: int = 2
    deadline_s: float = 300.0
    status_timeout_s: float = 60.0  # an agent whose last signed status is older is not asked
    # buffered asynchronous aggregation (FedBuff; docs/architecture.md, "Asynchronous rounds")
    mode: str = "sync"  # sync: a round waits for its selected agents; async: a model version every ``buffer`` updates
    buffer: int = 10  # async: updates folded into each new model version (FedBuff's K)
    staleness: str = DEFAULT_STALENESS  # async: the weight of an update trained ``s`` versions back (flcore.staleness)
    max_staleness: int = 10  # async: an update trained from an older version than this is refused as ``stale``
    max_concurrent: int = 0  # async: at most this many agents training on the server's word (0: every one online)
    server_lr: float = 1.0  # async: each version moves this fraction of the buffer's (staleness-scaled) mean step

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"rounds.fraction must be in (0, 1], got {self.fraction}")
        if self.min_agents < 1:
            raise ValueError(f"rounds.min_agents must be >= 1, got {self.min_agents}")
        if not 1 <= self.quorum <= self.min_agents:
            raise ValueError(
                f"rounds.quorum must be between 1 and rounds.min_agents ({self.min_agents}), got {self.quorum}"
            )
        if self.deadline_s <= 0:
            raise ValueError(f"rounds.deadline_s must be > 0, got {self.deadline_s}")
        if self.status_timeout_s <= 0:
            raise ValueError(
                f"rounds.status_timeout_s must be > 0 (and above the agents' status_interval_s), got "
                f"{self.status_timeout_s}"
            )
        self._check_async()

    def _check_async(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f'rounds.mode must be "sync" (rounds wait for their agents) or "async" (a new model '
                             f"version every rounds.buffer updates), got {self.mode!r}")  # fmt: skip
        Staleness.parse(self.staleness)
        for key in ("buffer", "max_staleness", "max_concurrent"):
            value, least = getattr(self, key), 0 if key == "max_concurrent" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"rounds.{key} must be a whole number >= {least}, got {value!r}")
        lr = self.server_lr
        if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and 0 < lr <= 10 and math.isfinite(lr)):
            raise ValueError(f"rounds.server_lr must be a number in (0, 10] (1 = the buffer's mean step), "
                             f"got {self.server_lr!r}")  # fmt: skip

    @property
    def is_async(self) -> bool:
        return self.mode == "async"

    @property
    def staleness_fn(self) -> Staleness:
        return Staleness.parse(self.staleness)


def select_agents(eligible: list[str], rules: RoundRules, seed: int) -> list[str]:
    """max(min_agents, ceil(fraction * eligible)) agents drawn without replacement, reproducibly."""
    count = min(len(eligible), max(rules.min_agents, math.ceil(rules.fraction * len(eligible))))
    return sorted(random.Random(seed).sample(sorted(eligible), count))


def select_with_probation(
    eligible: list[str], available: list[str], rules: RoundRules, seed: int
) -> tuple[list[str], list[str]]:
    """``(selected, probation)``: ``select_agents`` of the ``available`` agents (eligible, not backed off);
    where they are fewer than ``min_agents``, backed-off eligible agents make up the number, on probation."""
    selected = select_agents(available, rules, seed)
    backed_off, short = sorted(set(eligible) - set(available)), rules.min_agents - len(selected)
    probation = sorted(random.Random(seed).sample(backed_off, min(short, len(backed_off)))) if short > 0 else []
    return sorted(selected + probation), probation


@dataclass(frozen=True)
class UpdateRecord:
    """An accepted update as the round remembers it (its bytes are in the update store). Immutable: the checkpoint
    keeps each record's text between writes (``broker_server.rounds.state_text``)."""

    agent: str
    samples: int  # the update's weight: training samples for classifiers, annotated objects for detectors
    loss: float
    norm: float
    wire_bytes: int
    folded: float = 0.0  # coefficient a streaming strategy folded in while checking it (0: not folded)
    local_epsilon: float | None = None  # the agent's own DP-SGD epsilon, as its update's metadata says
    local_eval: dict[str, float] = field(default_factory=dict)  # the agent's own validation of its model
    start_eval: dict[str, float] = field(default_factory=dict)  # its start model on its local test split (C-SPE)
    trained_eval: dict[str, float] = field(default_factory=dict)  # its trained model on that split (trained C-SPE)
    late_from: int = 0  # a late update folded into this round: the round it was trained for (0: this round's)
    discount: float = 1.0  # its weight's factor after the bounds (``late_weight`` for a late one)
    staleness: int = 0  # model versions published since the one it was trained from (flcore.staleness)

    @property
    def key(self) -> str:
        """Names its contribution and its stored file: the agent, or ``agent@round`` for a late one (an agent
        may have both in one round)."""
        return f"{self.agent}@{self.late_from}" if self.late_from else self.agent


@dataclass
class RoundState:
    """One round in progress; serializable for the checkpoint."""

    round: int
    attempt: int
    selected: list[str]
    deadline: float
    started_at: float
    updates: list[UpdateRecord] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # selected agents whose own update was refused
    missed: list[str] = field(default_factory=list)  # selected agents excused: missed a deadline, or gave up
    action: str = "average"  # what the strategy does with the round's updates (average, swap, local)
    inbox_bytes: int = 0  # models sealed to agents' inboxes for this round (swap partners' and others)
    train: dict = field(default_factory=dict)  # the round's shared TrainSettings, as the strategy planned them
    agent_train: dict[str, dict] = field(default_factory=dict)  # agent -> its own TrainSettings, where they differ
    revoked: list[str] = field(default_factory=list)  # agents revoked during the round: the task tells them
    probation: list[str] = field(default_factory=list)  # backed-off agents selected only to make up min_agents
    trained: list[str] = field(default_factory=list)  # a ``local`` round: agents whose status says they trained it
    asked_at: float = 0.0  # when an agent was last asked to train for it (asynchronous rounds: joins ask later)
    wasted: dict[str, list[str]] = field(default_factory=dict)  # kind (late, stale) -> agents whose trained
    # update was refused for its age while it was open (each agent once: a rogue's flood counts once)

    @property
    def on_time(self) -> list[UpdateRecord]:
        """This round's own updates (not late ones folded in from the round before)."""
        return [u for u in self.updates if not u.late_from]

    @property
    def accepted(self) -> list[str]:
        return [u.agent for u in self.on_time]

    @property
    def folded_late(self) -> list[str]:
        """Late updates of the round before folded into this one, as ``agent@round``."""
        return [u.key for u in self.updates if u.late_from]

    @property
    def pending(self) -> list[str]:
        """Selected agents still waited for: not accepted, and not refused (they have no other update)."""
        done = set(self.accepted) | set(self.failed) | set(self.missed) | set(self.trained)
        return [a for a in self.selected if a not in done]

    @property
    def waited_for(self) -> list[str]:
        """Pending agents the round waits for: all but those on probation (they may still send in time)."""
        return [a for a in self.pending if a not in self.probation]

    @property
    def delivered(self) -> int:
        """Agents that did this round's work: updates accepted, or a ``local`` round trained (nothing uploaded)."""
        return len(self.on_time) + len(self.trained)

    @property
    def bytes_up(self) -> int:
        return sum(u.wire_bytes for u in self.updates)

    def to_dict(self) -> dict:
        """For the checkpoint, written after every accepted update: shallow (``asdict``'s deep copy made
        a round of 1,000 updates cost seconds of checkpointing)."""
        return {**vars(self), "updates": [dict(vars(u)) for u in self.updates]}

    def copy(self) -> RoundState:
        """A copy to put back if a change cannot be written (``broker_server.rounds.disk``): its lists are its own,
        the update records are shared."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: type(v)(v) for k, v in values.items() if isinstance(v, (list, dict))})

    @classmethod
    def from_dict(cls, data: dict) -> RoundState:
        updates = [UpdateRecord(**u) for u in data.pop("updates")]
        return cls(**data, updates=updates)


def replace_missing(
    state: RoundState, candidates: list[str], seed: int, quorum: int = 0
) -> tuple[list[str], list[str]]:
    """At a deadline without quorum: as many of ``candidates`` (eligible, not yet selected) as there are
    pending agents, plus as many as the ``quorum`` lacks beyond them (agents excused earlier: refused,
    or their training failed), join the round, drawn reproducibly, and that many pending agents are
    excused. Returns ``(excused, stand_ins)``; with no candidate left the pending agents are asked again."""
    pending = state.pending
    wanted = len(pending) + max(0, quorum - state.delivered - len(pending))
    available = sorted(set(candidates) - set(state.selected))
    stand_ins = sorted(random.Random(seed).sample(available, min(wanted, len(available))))
    excused = pending[: len(stand_ins)]
    state.missed.extend(excused)
    state.selected.extend(stand_ins)
    return excused, stand_ins


def complete(state: RoundState, rules: RoundRules, threshold: int = 0, arriving: frozenset[str] = frozenset()) -> bool:
    """Whether the round in progress has what it waits for, with the updates of ``arriving`` senders counted as in:
    nobody waited for with the quorum met (a backed-off agent on probation is not), or ``threshold`` updates in
    (SmartFed's static threshold, 0 = off); an asynchronous round, ``rules.buffer`` updates, late ones included."""
    if rules.is_async:
        return len(state.updates) + len(arriving) >= rules.buffer
    settled = len(state.updates) + len(state.failed) + len(state.missed) + len(state.trained) + len(state.probation)
    if threshold <= 0 and len(state.selected) - settled > len(arriving):
        return False  # at least that many are still waited for (each of those lists settles one agent at most): the
        # server asks this for each update it accepts, and the exact lists cost O(N) (6 % of it at 1,000 agents)
    delivered = state.delivered + len(arriving)
    waited = [agent for agent in state.waited_for if agent not in arriving]
    return (not waited and delivered >= rules.quorum) or (threshold > 0 and delivered >= threshold)


def decide(state: RoundState, rules: RoundRules, now: float, threshold: int = 0) -> str:
    """``"wait"``, ``"close"`` or ``"reannounce"`` for the round in progress: close as soon as it is ``complete``,
    or at the deadline with the quorum met; otherwise re-announce then. An asynchronous round is a buffer: at its
    deadline it closes on the quorum (agents still training go on into the next)."""
    if complete(state, rules, threshold):
        return "close"
    if now < state.deadline:
        return "wait"
    done = len(state.updates) if rules.is_async else state.delivered
    return "close" if done >= rules.quorum else "reannounce"
