"""Models mixed from the kept ones (``flcore.strategies.mixing``): ``keep_mixed`` keeps, in row order and under
the names given, exactly the rows ``mixed_models`` computes, over batches that reuse one buffer, two puts at once."""

from __future__ import annotations

import time

import numpy as np

from flcore.agent_models import Holding
from flcore.strategies import mixing
from flcore.strategies.base import Contribution


def test_keep_mixed_keeps_every_row_under_its_name_while_its_batch_is_current(monkeypatch):
    rng = np.random.default_rng(3)
    views = [Contribution(f"a{i}", rng.standard_normal(1000).astype(np.float32), 1.0, 1.0, 0.0) for i in range(6)]
    weights = rng.random((7, 6))
    monkeypatch.setattr(mixing, "MIX_BYTES", 3 * 4 * 1000)  # three rows a batch: batches of 3, 3 and 1
    want = [row.copy() for _, row in mixing.mixed_models(views, weights)]
    kept = {}

    def put(name: str, vector: np.ndarray) -> Holding:
        time.sleep(0.01)  # the buffer must still hold this row when it is read
        kept[name] = vector.copy()
        return Holding(1, f"+{name}", name)

    names = [f"m{r}" for r in range(7)]
    holdings = mixing.keep_mixed(put, names, views, weights)
    assert [h.sha256 for h in holdings] == names
    for r, name in enumerate(names):
        np.testing.assert_array_equal(kept[name], want[r])
    np.testing.assert_allclose(want[4], weights[4].astype(np.float32) @ np.stack([v.delta for v in views]), rtol=1e-5)
