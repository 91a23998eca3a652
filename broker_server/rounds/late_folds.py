"""Which late updates the open round folds in (``flcore.late``, ``flcore.staleness``), and the models they are
checked against.

Each closed round leaves a ``LateWindow`` in the checkpoint (its number, the model version it was announced with,
the selected agents it closed without). Synchronous rounds keep the last one: an update of one of those agents for
that round is folded into the open round at ``strategy.late_weight``. Asynchronous rounds (``rounds.mode =
"async"``) keep every window whose model is at most ``rounds.max_staleness`` versions behind the one in force, and
weigh an update by the staleness function of how many versions it is behind. An update is checked against the model
it was trained from, which the checkpoint keeps while a window names it; when that file is gone (a region adopting
its root's model), the window is left out and its late updates are refused as late.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from broker_server.rounds.accept import LateWindow, LateWindows, RoundInputs
from broker_server.rounds.engine_state import EngineState
from flcore.rounds import RoundRules
from flcore.staleness import Staleness
from flcore.strategies.base import Strategy
from flcore.update import float_layout
from models.weights import RUNNING_STATISTICS, ranges_of
from protocol.codecs import Codec

MAX_WINDOWS = 4  # closed rounds kept per version of rounds.max_staleness (a rolled-back buffer publishes none)
CACHED_VERSIONS = 4  # older models' float vectors held in memory (each read from the checkpoint once)


class LateFolds:
    def __init__(self, state: EngineState, strategy: Strategy, rules: RoundRules) -> None:
        self.state, self.strategy, self.rules = state, strategy, rules
        self.staleness = rules.staleness_fn if rules.is_async else Staleness.fixed(strategy.late_weight)
        self._cache: dict[int, np.ndarray] = {}  # version -> its float vector

    def windows(self) -> LateWindows:
        """The closed rounds whose late updates are folded into the open one (none, ``folding`` off, when
        synchronous rounds refuse them: ``late_weight`` = 0)."""
        kept = tuple(w for w in self.state.late if not w.owed or self._has(w.version))  # a model gone: lost
        folding = self.rules.is_async or bool(self.strategy.late_weight)
        return LateWindows(kept, self.state.version, self.staleness, self.rules.max_staleness if self.rules.is_async
                           else 0, folding)  # fmt: skip

    def inputs(self, agent: str, round_number: int, base: np.ndarray, *, codec: Codec, base_sha256: str) -> RoundInputs:
        """What an update of ``agent`` for ``round_number`` is checked against: the model its late window names, or
        ``base``, the model the open round asked it to start from. A late one joins as its model (``flcore.late``),
        in asynchronous rounds as its change (FedBuff), BatchNorm's running statistics as its model's."""
        late, state = self.windows(), self.state
        window = late.find(agent, round_number)
        version, vector = (window.version, self.base(window)) if window is not None else (state.version, base)
        return RoundInputs(state.float_spec, version, vector, state.positive, base_sha256=base_sha256,
                           next_round=state.next_round, codec=codec, late=late, current=state.global_vector,
                           staleness=state.version - version,
                           as_model=ranges_of(state.float_spec, RUNNING_STATISTICS) if self.rules.is_async else None)

    def after_close(self, closed: LateWindow, folded: list[str]) -> None:
        """Keep ``closed`` (the round just closed); the late updates it ``folded`` in (``agent@round``) are owed no
        more (each counts once); drop windows no late update can come from any more."""
        if not self.rules.is_async:
            self.state.late = (closed,)
            return
        done = set(folded)
        oldest = self.state.version - self.rules.max_staleness  # kept owing nobody too: a copy of a counted
        windows = [replace(w, owed=tuple(a for a in w.owed if f"{a}@{w.round}" not in done))  # update is not-owed
                   for w in (*self.state.late, closed) if w.version >= oldest]  # fmt: skip
        self.state.late = tuple(windows[-MAX_WINDOWS * self.rules.max_staleness:])  # rolled-back buffers publish
        # no version: their windows are bounded by count

    def held_for_next_round(self, agent: str, round_number: int) -> bool:
        """Between two rounds: whether an update of ``agent`` for ``round_number`` is folded into the next round
        once it opens (the daemon holds it until then)."""
        return self.state.round_state is None and self.windows().welcomes(agent, round_number)

    def base(self, window: LateWindow) -> np.ndarray:
        """The float vector of the model ``window``'s updates were trained from."""
        if window.version == self.state.version:
            return self.state.global_vector
        if window.version not in self._cache:
            arrays = self.state.store.load_version(window.version)
            assert arrays is not None  # ``windows`` checked that the checkpoint keeps it
            while len(self._cache) >= CACHED_VERSIONS:
                self._cache.pop(min(self._cache))
            self._cache[window.version] = float_layout(arrays)[1]
        return self._cache[window.version]

    def _has(self, version: int) -> bool:
        return version == self.state.version or version in self._cache or \
            (self.state.store.directory / f"global-v{version}.safetensors").exists()  # fmt: skip
