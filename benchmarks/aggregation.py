"""Streaming FedAvg of 100 updates x 3.2M float32 against the memory-bandwidth floor of the same run.

The timed path is the server's: ``validate_update`` (parse the safetensors header, check names and
shapes, one dot product for finiteness and norm) then ``FedAvg.accumulate`` (one saxpy), for every
update. The floor is a plain copy of the same bytes (every update copied into its own preallocated,
already-touched destination: read and write of 1.28 GB). Also reported, for transparency, is a stricter
"read-once" figure: every update copied into one 12.8 MB buffer that stays in cache, which is close to
the cost of merely reading the updates once. Target: <= 1.5x the floor, and peak extra memory that does
not grow with the number of updates.
"""

from __future__ import annotations

import tracemalloc

import numpy as np

from benchmarks.common import median_seconds, report
from broker_server.strategies import AcceptedUpdate
from broker_server.strategies.fedavg import FedAvg
from broker_server.validation import validate_update
from models.serialization import dumps, float32_region
from protocol.update import UpdateMeta

PARAMS = 3_200_000
SHAPES = {"backbone.weight": (2_400_000,), "head.weight": (799_990,), "head.bias": (10,)}


def make_updates(count: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    meta = UpdateMeta(round=1, base_version=1, samples=100, loss=0.5).to_metadata()
    updates = []
    for _ in range(count):
        arrays = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in SHAPES.items()}
        updates.append(dumps(arrays, metadata=meta))
    return updates


def aggregate(updates: list[bytes], spec, global_vector: np.ndarray) -> np.ndarray:  # noqa: ANN001
    strategy = FedAvg()
    strategy.begin(global_vector)
    for data in updates:
        update = validate_update(data, expected_spec=spec, round_number=1, model_version=1)
        strategy.accumulate(AcceptedUpdate("agent", update.delta, update.meta.samples, update.meta.loss))
    return strategy.finalize().global_vector


def copy_into(updates: list[bytes], sinks: list[np.ndarray]) -> None:
    """Copy each update's tensor bytes into ``sinks[i]`` (or all into one sink when given only one)."""
    for i, data in enumerate(updates):
        sink = sinks[i % len(sinks)]
        np.copyto(sink, np.frombuffer(data, np.float32, count=sink.size, offset=len(data) - sink.nbytes))


def peak_extra_bytes(updates: list[bytes], spec, global_vector: np.ndarray) -> int:  # noqa: ANN001
    tracemalloc.start()
    tracemalloc.reset_peak()
    aggregate(updates, spec, global_vector)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def main(repeats: int = 9) -> list[dict]:
    updates = make_updates(100)
    _, spec, _ = float32_region(updates[0])
    global_vector = np.zeros(PARAMS, np.float32)
    destinations = list(np.ones((len(updates), PARAMS), np.float32))  # touched, so no page faults are timed
    floor = median_seconds(lambda: copy_into(updates, destinations), repeats)
    read_once = median_seconds(lambda: copy_into(updates, destinations[:1]), repeats)
    fedavg = median_seconds(lambda: aggregate(updates, spec, global_vector), repeats)
    peak_10 = peak_extra_bytes(updates[:10], spec, global_vector)
    peak_100 = peak_extra_bytes(updates, spec, global_vector)
    ratio = fedavg / floor
    return [
        report(
            "fedavg_100x3.2M",
            target="<= 1.5x copy floor; peak memory flat in N",
            ok=ratio <= 1.5 and peak_100 <= peak_10 * 1.05,
            fedavg_ms=round(fedavg * 1e3, 1),
            copy_floor_ms=round(floor * 1e3, 1),
            ratio=round(ratio, 2),
            read_once_ms=round(read_once * 1e3, 1),
            ratio_to_read_once=round(fedavg / read_once, 2),
            peak_extra_mb_10_updates=round(peak_10 / 2**20, 1),
            peak_extra_mb_100_updates=round(peak_100 / 2**20, 1),
        )
    ]


if __name__ == "__main__":
    main()
