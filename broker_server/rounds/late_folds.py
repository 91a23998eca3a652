"""Which late updates the open round folds in (``flcore.late``), and the model they are checked against.

The round closed last leaves a ``LateWindow`` in the checkpoint (its number, the model version it was announced
with, the selected agents it closed without); an update of one of those agents for that round is folded into the
open round, checked against the model it was trained from: the one in force when that round did not publish,
else the one before it, which the checkpoint keeps as the fallback (``broker_server.rounds.fallback``). When
neither is that version any more (a fallback, a region adopting its root's model), late updates are refused.
"""

from __future__ import annotations

import numpy as np

from broker_server.rounds.accept import LateWindow
from broker_server.rounds.engine_state import EngineState
from flcore.strategies.base import Strategy
from flcore.update import float_layout


class LateFolds:
    def __init__(self, state: EngineState, strategy: Strategy) -> None:
        self.state, self.strategy = state, strategy
        self._cache: tuple[int, np.ndarray] = (0, np.zeros(0, np.float32))  # (version, its float vector)

    def window(self) -> LateWindow | None:
        """The round before, whose late updates are folded into the open one; None when ``late_weight`` = 0 (late
        updates are refused as before); owing nobody when the model they were trained from is no longer kept."""
        late, state = self.state.late, self.state
        if not self.strategy.late_weight:
            return None
        return late if late.version in (state.version, state.fallback.version) else LateWindow(late.round)

    def held_for_next_round(self, agent: str, round_number: int) -> bool:
        """Between two rounds: whether an update of ``agent`` for ``round_number`` is folded into the next round
        once it opens (the daemon holds it until then)."""
        late = self.window()
        return self.state.round_state is None and late is not None and late.welcomes(agent, round_number)

    def base(self, late: LateWindow) -> np.ndarray:
        """The float vector of the model ``late``'s updates were trained from (read from disk once per version)."""
        if late.version == self.state.version:
            return self.state.global_vector
        if self._cache[0] != late.version:
            arrays = self.state.store.load_version(late.version)
            assert arrays is not None  # ``window`` checked that the checkpoint keeps it
            self._cache = (late.version, float_layout(arrays)[1])
        return self._cache[1]
