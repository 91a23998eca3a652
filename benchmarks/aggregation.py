"""The server's accept path against the memory-copy floor, the end of a round, and each strategy's cost.

1. **Accept path**, 100 updates x 3.2M float32: ``broker_server.rounds.accept.accept_update`` as the server
   runs it — parse the safetensors header, check names and shapes, then one pass over the values that
   checks them, measures the norm and folds them into FedAvg's running sum (``onepass.scan``) under
   the default bounds — with the disk write left out (a store that keeps nothing). Floor: a plain copy
   of the same bytes into preallocated, already-touched destinations (read + write of 1.28 GB).
   Target: <= 1.2x the floor. Also reported: a stricter "read once" floor (every update copied into
   one cache-resident buffer).
2. **End of round**: ``FedAvg.aggregate`` with the default bounds (deferred and corrected updates
   re-read), reported in ms.
3. **Robust strategies**, 20 updates x 3.2M: ``aggregate`` time per strategy as a ratio to copying the
   same bytes once. Target: <= 5x each (they read every update once or twice in cache-sized column
   blocks: a sorting network per block for median and trimmed mean, float32 BLAS for Krum's Gram matrix
   and the weighted sums).
4. **Peak extra memory** of the accept path (tracemalloc): flat in the number of updates.
"""

from __future__ import annotations

import tracemalloc

import numpy as np

from benchmarks.common import median_seconds, report
from broker_server.rounds.accept import RoundInputs, accept_update
from flcore.bounds import InfluencePolicy, bound_influence
from flcore.rounds import RoundState
from flcore.strategies import build_strategy
from flcore.strategies.base import Contribution
from flcore.update import UpdateMeta
from models.serialization import dumps, float32_region
from protocol.transfer import Completed
from security.envelope import NO_DIGEST, Manifest

PARAMS = 3_200_000
SHAPES = {"backbone.weight": (2_400_000,), "head.weight": (799_990,), "head.bias": (10,)}
POLICY = InfluencePolicy()


class DiscardingStore:
    """The update store minus the disk: what the benchmark leaves out of the accept path."""

    def put(self, round_number: int, agent: str, data: object) -> None:
        pass


def make_updates(count: int, seed: int = 0) -> list[Completed]:
    rng = np.random.default_rng(seed)
    updates = []
    for i in range(count):
        samples = int(rng.integers(100, 400))
        meta = UpdateMeta(round=1, base_version=1, samples=samples, loss=0.5).to_metadata()
        arrays = {name: 0.01 * rng.standard_normal(shape, dtype=np.float32) for name, shape in SHAPES.items()}
        data = dumps(arrays, metadata=meta)
        manifest = Manifest("b", "update", 1, f"agent-{i}", "server", bytes(16), 0.0, len(data), 1 << 20,
                            -(-len(data) // (1 << 20)), NO_DIGEST)  # fmt: skip
        updates.append(Completed(manifest, memoryview(data), len(data)))
    return updates


def accept_all(updates: list[Completed], spec, global_vector: np.ndarray):  # noqa: ANN001, ANN201
    """Every update through the server's accept path; returns the strategy and round state."""
    strategy = build_strategy({"name": "fedavg"})
    strategy.begin(global_vector, spec)
    state = RoundState(round=1, attempt=1, selected=[u.manifest.sender for u in updates], deadline=0, started_at=0)
    inputs = RoundInputs(spec, 1, global_vector)
    for completed in updates:
        accept_update(completed, state, inputs, policy=POLICY, strategy=strategy, store=DiscardingStore())
    return strategy, state


def contributions_of(state: RoundState, updates: list[Completed]) -> list[Contribution]:
    influence = bound_influence(
        POLICY, np.array([u.norm for u in state.updates]), np.array([u.samples for u in state.updates], float)
    )
    deltas = {u.manifest.sender: float32_region(u.data)[0] for u in updates}
    return [
        Contribution(r.agent, deltas[r.agent], float(w), float(s), r.norm, r.folded)
        for r, w, s in zip(state.updates, influence.samples, influence.scales, strict=True)
    ]


def copy_into(updates: list[Completed], sinks: list[np.ndarray]) -> None:
    """Copy each update's tensor bytes into ``sinks[i]`` (or all into one sink when given only one)."""
    for i, completed in enumerate(updates):
        sink = sinks[i % len(sinks)]
        data = completed.data
        np.copyto(sink, np.frombuffer(data, np.float32, count=sink.size, offset=len(data) - sink.nbytes))


def peak_extra_bytes(updates: list[Completed], spec, global_vector: np.ndarray) -> int:  # noqa: ANN001
    tracemalloc.start()
    tracemalloc.reset_peak()
    accept_all(updates, spec, global_vector)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def robust_costs(updates: list[Completed], spec, global_vector: np.ndarray, repeats: int) -> dict:  # noqa: ANN001
    _, state = accept_all(updates, spec, global_vector)
    contributions = contributions_of(state, updates)
    sinks = list(np.ones((len(updates), PARAMS), np.float32))
    floor = median_seconds(lambda: copy_into(updates, sinks), repeats)
    figures = {"robust_updates": len(updates), "robust_copy_floor_ms": round(floor * 1e3, 1)}
    for table in ({"name": "median"}, {"name": "trimmed-mean"}, {"name": "krum", "f": 2}, {"name": "centered-clip"},
                  {"name": "auto"}):  # auto: its deciding round (one Gram matrix more, then one of the two)
        strategy = build_strategy(table)
        strategy.begin(global_vector, spec)
        seconds = median_seconds(lambda s=strategy: s.aggregate(global_vector, contributions), max(3, repeats // 2))
        figures[f"{table['name']}_ms"] = round(seconds * 1e3, 1)
        figures[f"{table['name']}_ratio"] = round(seconds / floor, 1)
    return figures


def main(repeats: int = 9) -> list[dict]:
    updates = make_updates(100)
    _, spec, _ = float32_region(updates[0].data)
    global_vector = np.zeros(PARAMS, np.float32)
    destinations = list(np.ones((len(updates), PARAMS), np.float32))  # touched, so no page faults are timed
    floor = median_seconds(lambda: copy_into(updates, destinations), repeats)
    read_once = median_seconds(lambda: copy_into(updates, destinations[:1]), repeats)
    accept = median_seconds(lambda: accept_all(updates, spec, global_vector), repeats)
    strategy, state = accept_all(updates, spec, global_vector)
    contributions = contributions_of(state, updates)
    finalize = median_seconds(lambda: strategy.aggregate(global_vector, contributions), repeats)
    destinations.clear()  # give the 1.28 GB back before the memory measurement
    peak_10 = peak_extra_bytes(updates[:10], spec, global_vector)
    peak_100 = peak_extra_bytes(updates, spec, global_vector)
    ratio = accept / floor
    rows = [
        report(
            "accept_path_100x3.2M",
            target="<= 1.2x copy floor; peak memory flat in N",
            ok=ratio <= 1.2 and peak_100 <= peak_10 * 1.05,
            accept_ms=round(accept * 1e3, 1),
            copy_floor_ms=round(floor * 1e3, 1),
            ratio=round(ratio, 2),
            read_once_ms=round(read_once * 1e3, 1),
            ratio_to_read_once=round(accept / read_once, 2),
            folded_while_checked=sum(bool(r.folded) for r in state.updates),
            end_of_round_ms=round(finalize * 1e3, 1),
            peak_extra_mb_10_updates=round(peak_10 / 2**20, 1),
            peak_extra_mb_100_updates=round(peak_100 / 2**20, 1),
        )
    ]
    robust = robust_costs(updates[:20], spec, global_vector, repeats)
    worst = max(value for key, value in robust.items() if key.endswith("_ratio") and not key.startswith("auto"))
    rows.append(report("robust_strategies_20x3.2M", target="<= 5x copy floor each (auto: reported)", ok=worst <= 5,
                       **robust))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
