"""Fixtures and builders shared by several test files, all in-process: engine configs and updates, rows of a run,
datasets, codec round trips, hostile payloads. A test file imports these from here, never from another test file
(tests/test_suite_layout.py checks); the fixtures several files use are registered in tests/conftest.py.
"""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from broker_server.config import load_server_config
from broker_server.rounds.engine import RoundEngine
from flcore.strategies.base import Contribution
from flcore.update import UpdateMeta
from models.serialization import dumps, loads, save_file
from models.synthetic_detection import NAMES, write_dataset
from models.weights import float_part, spec_of, to_arrays
from models.zoo import build_model
from participant.detector import DetectorTrainer
from protocol.codecs import Codec, decode, encode
from protocol.messages import RoundTask, TrainSettings
from protocol.transfer import Completed
from security.envelope import NO_DIGEST, Manifest
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml, round_task

SIZE = 64
CLASSES = list(NAMES)


# --- a RoundEngine's config, round and random updates
@pytest.fixture
def config(tmp_path):
    """A RoundEngine's server config: three agents, all needed for a round."""
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=3, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3})
    return load_server_config(layout.server_config)


def random_delta(engine: RoundEngine, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    floats = float_part(engine.global_arrays)
    return {k: (0.01 * rng.standard_normal(floats[k].shape)).astype(np.float32) for k in sorted(floats)}


def completed(engine: RoundEngine, agent: str, seed: int, samples: int = 100, weight: int = 0) -> Completed:
    meta = UpdateMeta(round=engine.round_state.round, base_version=engine.version, samples=samples, loss=0.3,
                      weight=weight)  # fmt: skip
    data = dumps(random_delta(engine, seed), metadata=meta.to_metadata())
    manifest = Manifest("e", "update", engine.round_state.round, agent, "server", bytes(16), 0.0, len(data), 1 << 20,
                        1, NO_DIGEST)  # fmt: skip
    return Completed(manifest, memoryview(data), len(data))


def open_round(engine: RoundEngine) -> None:
    engine.begin_round(["agent-01", "agent-02", "agent-03"], now=0.0)
    engine.announce(now=0.0)


# --- updates central DP can take
def dp_completed(engine: RoundEngine, agent: str, seed: int, samples: int = 100):  # noqa: ANN201
    """A random update that leaves BatchNorm running variances alone: after noise some are exactly zero,
    and a random change would then make them negative (refused, as an honest agent's never is)."""
    update = completed(engine, agent, seed, samples=samples)
    arrays, meta = loads(bytes(update.data))
    arrays = {k: np.zeros_like(v) if k.endswith("running_var") else v for k, v in arrays.items()}
    data = dumps(arrays, metadata=meta)
    return dataclasses.replace(update, data=memoryview(data))


# --- updates that claim the base the engine assigned
AGENTS = ["agent-01", "agent-02", "agent-03"]


def update(engine: RoundEngine, agent: str, seed: int, *, base_sha256: str | None = None, samples: int = 100,
           scale: float = 1.0, fill: dict[str, float] | None = None):  # fmt: skip
    """A random delta as ``agent`` would send it, claiming the base the engine assigned unless told; the
    tensors named in ``fill`` change by that constant instead."""
    rng = np.random.default_rng(seed)
    floats = float_part(engine.global_arrays)
    delta = {k: (0.01 * scale * rng.standard_normal(floats[k].shape)).astype(np.float32) for k in sorted(floats)}
    for name, value in (fill or {}).items():
        delta[name][...] = value
    assigned = engine.assignments.get(agent)
    claimed = base_sha256 if base_sha256 is not None else (assigned.model.sha256 if assigned else "")
    meta = UpdateMeta(engine.round_state.round, engine.version, samples, 0.3, base_sha256=claimed)
    data = dumps(delta, metadata=meta.to_metadata())
    manifest = Manifest("e", "update", engine.round_state.round, agent, "server", bytes(16), 0.0, len(data), 1 << 20,
                        1, NO_DIGEST)  # fmt: skip
    return Completed(manifest, memoryview(data), len(data)), delta


def run_round(engine: RoundEngine, seed: int) -> dict:
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    sent = {}
    for i, agent in enumerate(AGENTS):
        done, delta = update(engine, agent, seed + i, samples=100 * (i + 1))
        sent[agent] = (engine.start_model(agent), delta)
        engine.accept(done)
    return sent


# --- the server's state file
def state_json(server_config) -> dict:  # noqa: ANN001
    return json.loads((server_config.state_dir / "checkpoint" / "state.json").read_text())


# --- aggregation inputs
def contributions(deltas, samples=None, scales=None, folded=None):
    n = len(deltas)
    samples = samples if samples is not None else [1.0] * n
    scales = scales if scales is not None else [1.0] * n
    folded = folded if folded is not None else [0.0] * n
    return [
        Contribution(f"a{i}", d, float(s), float(c), float(np.linalg.norm(d)), float(f))
        for i, (d, s, c, f) in enumerate(zip(deltas, samples, scales, folded, strict=True))
    ]


# --- a tiny detection dataset and task
@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A tiny synthetic detection dataset (8 train, 4 val images of ``SIZE`` pixels)."""
    return write_dataset(tmp_path_factory.mktemp("det") / "data", train=8, val=4, seed=3, size=SIZE)


def detect_task(lr: float = 0.01, momentum: float = 0.9, **overrides: object):
    train = TrainSettings(epochs=1, batch_size=4, lr=lr, momentum=momentum, image_size=SIZE)
    return round_task(**{"model": "yolo11n", "num_classes": len(CLASSES), "classes": CLASSES, "train": train,
                         **overrides})  # fmt: skip


def trainer_for(dataset: Path, tmp_path: Path) -> DetectorTrainer:
    return DetectorTrainer(dataset, device=torch.device("cpu"), agent_id="agent-01", work_dir=tmp_path / "work")


def start_arrays(seed: int, model: str = "yolo11n") -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    return to_arrays(build_model(model, num_classes=len(CLASSES)))


# --- a run folder's rows, as the sim writes them
def write_run(folder: Path, rows: list[dict], **files: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, content in files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return folder


def round_row(number: int, **fields: object) -> dict:
    return {"round": number, "accepted": ["agent-1", "agent-2"], "rejected": [], "missed": [], **fields}


def peer_rows(peers: int = 3, rounds: int = 3) -> list[dict]:
    """What ``sim.peer_run`` writes: one row per peer and round, interleaved by round."""
    names = [f"peer-{i}" for i in range(1, peers + 1)]
    return [{"schema": "skyfed.peer-metrics/1", "peer": name, "round": r, "outcome": "aggregated",
             "eval": {"accuracy": round(0.5 + 0.1 * r + 0.01 * i, 6), "loss": round(2.0 - 0.3 * r, 6)},
             "aggregated_from": [n for n in names if n != "peer-3"] if r == 2 else names,
             "rejected": [{"peer": "peer-3", "reason": "bounds: norm"}] if r == 2 else [], "round_s": 1.0,
             "bytes_sent": 1000, "attackers": [], "attack": None, "mode": "peer",
             "personal": {"trained": {"c_spe": 0.9}}}
            for r in range(1, rounds + 1) for i, name in enumerate(names)]  # fmt: skip


def election_rows(holders: list[str], owner: str, sha: str = "ab" * 32) -> dict:
    return {p: {"peer": p, "adopted_from": owner, "sha256": sha, "refused": ""} for p in holders}


# --- hostile payloads
@st.composite
def mutated(draw, sources: list[bytes]) -> bytes:
    """A valid payload with a few random flips, a truncation or an insertion."""
    data = bytearray(draw(st.sampled_from(sources)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif data:
            value = draw(st.integers(0, 2**32 - 1)).to_bytes(4, "big")
            data[pos : pos + 4] = value
    return bytes(data)


def bounded(fn, payload: bytes, errors: tuple[type[BaseException], ...]) -> None:
    """Call ``fn(payload)``: only ``errors`` may escape, and the peak allocation stays proportional."""
    tracemalloc.start()
    try:
        fn(payload)
    except errors:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= 64 * len(payload) + (2 << 20), f"{peak} bytes allocated for a {len(payload)}-byte input"


# --- codec round trips
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FP32_UPDATE_BYTES = 155_384  # one digits-CNN update, fp32 (docs/results/codecs.md)


@st.composite
def changes(draw) -> dict[str, np.ndarray]:
    """A few float32 tensors of mixed ranks and magnitudes, sometimes with running statistics."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shapes = draw(st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1, max_size=4))
    out = {f"layer{i}.weight": rng.standard_normal(s) * 10.0 ** rng.integers(-4, 2) for i, s in enumerate(shapes)}
    if draw(st.booleans()):
        out["bn.running_var"] = rng.standard_normal(3)
    return {name: a.astype(np.float32) for name, a in out.items()}


def round_trip(change: dict[str, np.ndarray], text: str) -> dict[str, np.ndarray]:
    codec = Codec.parse(text)
    decoded = decode(encode(change, codec), codec, spec_of(change))
    assert list(decoded) == list(change)
    assert all(decoded[n].dtype == np.float32 and decoded[n].shape == change[n].shape for n in change)
    return decoded


# --- a recipe's kept state, damaged
def damage(path: Path, how: str, arrays: dict[str, np.ndarray]) -> None:
    """Write a kept-state file as a crash or a bad disk leaves it: ``garbage`` bytes, ``arrays`` all NaN (``nan``),
    or another layout (``other-layout``)."""
    if how == "garbage":
        path.write_bytes(b"\x00" * 64)
    else:
        save_file(path, {n: np.full_like(a, np.nan) for n, a in arrays.items()} if how == "nan" else {"x": np.zeros(3)})


# --- a peer's round task and models
def peer_task(round_number: int, strategy: str = "fedavg") -> RoundTask:
    """The task a peer builds for itself in ``round_number`` (agent.peer.rounds)."""
    return RoundTask(federation="sim", round=round_number, attempt=0, strategy=strategy, model="digits_cnn",
                     num_classes=10, model_version=round_number - 1, model_sha256="", model_chunks=0, group_key_id="",
                     selected=["agent-01"], pending=[], deadline=0.0, issued_at=0.0, run_id="peer-0")  # fmt: skip


def nudged(model: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """``model`` with N(0, 0.01²) added to every float: another peer's model after a round."""
    rng = np.random.default_rng(seed)
    return {k: v + rng.normal(0, 0.01, v.shape).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in model.items()}
