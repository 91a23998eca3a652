"""Seed 002's hybrid data sharing: the server's shared pool as one more participant (``[pool] data``), the sim's
``--share-ratio``/``--share-mode`` carving it out of the agents' data, and ``training.optimizer``."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from broker_server.config import load_server_config
from broker_server.config_summary import server_summary
from broker_server.daemon import Aggregator
from broker_server.pool import POOL
from broker_server.privacy.noise import NORM_SLACK
from common import toml
from models.datasets import Dataset, load_dataset, load_digits
from models.partition import share
from models.serialization import dumps, load_file
from participant.classifier import ClassifierTrainer
from protocol.config import ConfigError
from protocol.messages import MessageError, TrainSettings
from sim.federation import SimSettings, create_federation
from sim.run import run_sim
from tests.fedharness import Federation, override_toml, round_task

QUICK = {"model": "mlp_digits", "epochs": 1, "in_process": True, "strategy": {"name": "fedavg"}}


def _rows(out):  # noqa: ANN001, ANN202
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- the split (models.partition.share) ------------------------------------------------------------------
def test_unify_and_share_disjoint_split_the_thesis_worked_example():
    """10 clients × 100 samples at ratio 0.2: unify merges 2 whole clients (pool 200, 8 keep 100 each);
    share-disjoint takes 20 of each (pool 200, 10 keep 80 each). Nothing is lost or duplicated."""
    parts = [np.arange(i * 100, (i + 1) * 100) for i in range(10)]
    unify = share(parts, 0.2, "unify", seed=0)
    assert len(unify.pool) == 200 and [len(p) for p in unify.parts] == [100] * 8 and len(unify.gave_all) == 2
    assert np.array_equal(np.sort(np.concatenate([unify.pool, *unify.parts])), np.arange(1000))
    assert np.array_equal(unify.pool, np.sort(np.concatenate([parts[i] for i in unify.gave_all])))
    disjoint = share(parts, 0.2, "share-disjoint", seed=0)
    assert len(disjoint.pool) == 200 and [len(p) for p in disjoint.parts] == [80] * 10 and disjoint.gave_all == ()
    assert np.array_equal(np.sort(np.concatenate([disjoint.pool, *disjoint.parts])), np.arange(1000))
    assert all(len(np.intersect1d(p, q)) == 20 for p, q in zip(parts, [disjoint.pool] * 10, strict=True))


def test_share_ratio_zero_means_no_pool_and_ratios_that_leave_nobody_are_refused():
    parts = [np.arange(i * 10, (i + 1) * 10) for i in range(4)]
    for mode in ("unify", "share-disjoint"):
        none = share(parts, 0.0, mode, seed=1)
        assert len(none.pool) == 0 and all(np.array_equal(a, b) for a, b in zip(none.parts, parts, strict=True))
    assert len(share(parts, 0.2, "unify", seed=1).pool) == 0  # ⌊0.2 · 4⌋ = 0 agents
    with pytest.raises(ValueError, match="leaving no agent"):
        share(parts, 1.0, "unify", seed=1)
    with pytest.raises(ValueError, match="leaving it nothing to train on"):
        share(parts, 1.0, "share-disjoint", seed=1)
    with pytest.raises(ValueError, match="share mode must be one of unify, share-disjoint"):
        share(parts, 0.5, "unfiy", seed=1)


def test_the_sim_writes_the_pool_and_names_it_in_server_toml(tmp_path):
    settings = SimSettings(agents=5, rounds=1, partition="shards:1", share_ratio=0.4, share_mode="unify")
    layout = create_federation(tmp_path / "u", settings, ("127.0.0.1", 1))
    assert list(layout.agent_configs) == ["agent-01", "agent-02", "agent-03"]  # ⌊0.4 · 5⌋ = 2 gave all
    server = toml.loads(layout.server_config.read_text())
    assert server["pool"] == {"data": "shared.npz"} and server["training"]["optimizer"] == "sgd"
    pool = load_dataset(layout.server_config.parent / "shared.npz")
    agents = sum(
        len(load_dataset(p.parent / f)) for p in layout.agent_configs.values() for f in ("data.npz", "test.npz")
    )
    assert len(pool) + agents == len(load_digits(seed=0)[0])  # every sample is either pooled or an agent's
    assert len(np.unique(pool.y)) <= 4  # shards:1 of 5 agents: each share holds about 2 of the 10 labels
    assert any(line.startswith(f"{POOL}: {len(pool)} samples") for line in layout.description)
    settings = SimSettings(agents=4, rounds=1, partition="iid", share_ratio=0.25)  # share-disjoint by default
    layout = create_federation(tmp_path / "d", settings, ("127.0.0.1", 1))
    assert len(layout.agent_configs) == 4
    shares = np.array_split(np.arange(len(load_digits(seed=0)[0])), 4)  # iid: near-equal shares
    assert len(load_dataset(layout.server_config.parent / "shared.npz")) == sum(int(0.25 * len(s)) for s in shares)
    layout = create_federation(tmp_path / "none", SimSettings(agents=2, rounds=1), ("127.0.0.1", 1))
    assert "pool" not in toml.loads(layout.server_config.read_text())


def test_the_sim_refuses_share_settings_that_cannot_run():
    assert SimSettings(agents=3, share_ratio=0.67, share_mode="unify").running_agents == 1  # ⌊2.01⌋ gave all
    with pytest.raises(ValueError, match="--attackers must be below the 1 agents that still run"):
        SimSettings(agents=3, share_ratio=0.67, share_mode="unify", attackers=1, attack="sign-flip")
    with pytest.raises(ValueError, match="--share-ratio must be in"):
        SimSettings(agents=2, share_ratio=1.0)
    with pytest.raises(ValueError, match="--share-mode must be one of"):
        SimSettings(agents=2, share_ratio=0.1, share_mode="pool")


# -- the pool participant --------------------------------------------------------------------------------
def test_the_pools_update_is_refused_and_clipped_exactly_as_an_agents(tmp_path):
    """The pool trains on its 30 % (more steps: its update is longer than the agents'). A norm limit between
    the two (agents ≈ 0.50, pool ≈ 0.88 with this seed) refuses the pool with the agents' reason and keeps it
    out of the average; as a fixed clip, the same number clips the pool (and only it), which is then averaged,
    listed in ``accepted``."""
    settings = SimSettings(agents=3, rounds=1, partition="iid", share_ratio=0.3, **QUICK,
                           bounds={"max_update_norm": 0.7})  # fmt: skip
    run_sim(settings, tmp_path / "limit", echo=lambda _line: None)
    row = _rows(tmp_path / "limit")[0]
    assert row["accepted"] == ["agent-01", "agent-02", "agent-03"], row
    assert [(r["agent"], r["reason"].split(":")[0]) for r in row["rejected"]] == [(POOL, "norm-too-large")]
    assert row["participants"] == ["agent-01", "agent-02", "agent-03", POOL]
    settings = SimSettings(agents=3, rounds=1, partition="iid", share_ratio=0.3, **QUICK,
                           bounds={"clip": "fixed", "clip_norm": 0.7})  # fmt: skip
    run_sim(settings, tmp_path / "clip", echo=lambda _line: None)
    row = _rows(tmp_path / "clip")[0]
    assert row["accepted"] == ["agent-01", "agent-02", "agent-03", POOL] and row["rejected"] == []
    assert row["aggregation"]["clipped"] == [POOL] and row["outcome"] == "committed"
    model_bytes = len(dumps(load_file(tmp_path / "clip" / "global_model.safetensors")[0]))
    assert row["bytes_down"] == 3 * model_bytes  # the pool trains in the server: it downloads nothing


def test_the_pool_is_clipped_counted_and_charged_under_central_dp(tmp_path):
    """Central DP: the pool's update is one of the n clipped updates the noise is calibrated for (std z·S'/n
    with n = agents + 1), and the ledger charges it a round like every agent."""
    settings = SimSettings(agents=3, rounds=2, partition="iid", share_ratio=0.2, **{**QUICK, "strategy": {}},
                           privacy={"clip": 0.5, "noise_multiplier": 1.0})  # fmt: skip
    run_sim(settings, tmp_path / "dp", echo=lambda _line: None)
    rows = _rows(tmp_path / "dp")
    for row in rows:
        assert POOL in row["accepted"] and len(row["accepted"]) == 4
        assert row["aggregation"]["noise_std"] == pytest.approx(1.0 * 0.5 * (1 + NORM_SLACK) / 4, rel=1e-6)
    state = json.loads((tmp_path / "dp" / "federation" / "server" / "state" / "checkpoint" / "state.json").read_text())
    charged = state["privacy"]["charged"]
    assert charged[POOL] == charged["agent-01"] == {"1.0": 2}


def test_the_aggregator_trains_its_pool_beside_agents_over_a_broker(tmp_path, broker):
    """The daemon: the pool trains on its thread while agents deliver over MQTT, and the round averages it."""
    fed = Federation(tmp_path, broker, rounds=2, agents=2, model="mlp_digits", share_ratio=0.25,
                     strategy={"name": "fedavg"})  # fmt: skip
    fed.run(Aggregator(load_server_config(fed.layout.server_config)))
    metrics = fed.metrics()
    assert [m.round for m in metrics] == [1, 2]
    assert all(sorted(m.accepted) == ["agent-01", "agent-02", POOL] and m.outcome == "committed" for m in metrics), [
        (m.accepted, m.outcome, m.rejected) for m in metrics
    ]
    assert (fed.server_state / "pool").is_dir()  # its own state folder (momentum, the codec's residual)


def test_a_pool_whose_training_fails_is_excused_and_the_round_goes_on(tmp_path, broker):
    """The pool's data goes bad after the start check (labels the model has no class for): its training fails
    on its thread, the server excuses it (``missed``) and closes the round on the agents' updates at once."""
    fed = Federation(tmp_path, broker, rounds=1, agents=2, model="mlp_digits", share_ratio=0.25,
                     strategy={"name": "fedavg"})  # fmt: skip
    server = Aggregator(load_server_config(fed.layout.server_config))
    assert server.pool is not None
    trainer = server.pool.client.runner.trainer
    trainer.data = Dataset(trainer.data.x, trainer.data.y + 100)
    started = time.monotonic()
    fed.run(server)
    [m] = fed.metrics()
    assert sorted(m.accepted) == ["agent-01", "agent-02"] and m.missed == [POOL] and m.outcome == "committed"
    assert time.monotonic() - started < 30  # not the round's 60 s deadline


def test_the_pool_stores_its_update_as_an_agent_does_and_a_dropped_job_leaves_nothing(tmp_path, broker):
    """Through ``participant.round_client``: the pool's update is encoded and kept on disk like an agent's; a job
    dropped after it finished (its round closed) is neither encoded nor kept."""
    from broker_server.pool.shared import SharedPool
    from models.weights import to_arrays
    from models.zoo import build_model

    fed = Federation(tmp_path, broker, rounds=1, agents=1, model="mlp_digits", share_ratio=0.25,
                     strategy={"name": "fedavg"})  # fmt: skip
    pool = SharedPool(load_server_config(fed.layout.server_config), device=torch.device("cpu"))
    base = to_arrays(build_model("mlp_digits", num_classes=10))
    task = round_task(model="mlp_digits", selected=[POOL], pending=[POOL], train=TrainSettings(epochs=1))
    pool.start(task, base)
    training = pool.client.training
    assert training is not None and pool.round == 1
    deadline = time.monotonic() + 60
    while training.job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.cancel("the round closed")
    assert pool.round is None and pool.poll() is None and pool.client.store.stored_update(1) is None
    pool.start(task, base)
    result = pool.wait()
    assert result is not None and result.update is not None
    assert pool.client.store.stored_update(1) == bytes(result.update.data)


def test_server_toml_refuses_a_pool_that_cannot_work(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=2, rounds=1, share_ratio=0.2), ("127.0.0.1", 1))
    path = layout.server_config
    assert load_server_config(path).pool_path == path.parent / "shared.npz"
    assert f"pool={path.parent / 'shared.npz'}" in server_summary(load_server_config(path))  # skyfed server check
    override_toml(path, pool={"data": "missing.npz"})
    with pytest.raises(ConfigError, match="pool.data = 'missing.npz': shared data pool"):
        load_server_config(path)
    override_toml(path, pool={"data": "shared.npz"}, strategy={"name": "fedswap"})
    with pytest.raises(ConfigError, match=r"\[pool\] with strategy fedswap"):
        load_server_config(path)
    np.savez(path.parent / "labels.npz", x=np.zeros((4, 8, 8), np.float32), y=np.array([0, 1, 2, 10]))
    override_toml(path, strategy={"name": "fedavg"}, pool={"data": "labels.npz"})
    with pytest.raises(ConfigError, match="pool.data holds label 10, and server.num_classes is 10"):
        load_server_config(path)
    override_toml(path, pool={"dat": "shared.npz"})
    with pytest.raises(ConfigError, match="pool.dat is not a known key; did you mean 'data'"):
        load_server_config(path)


# -- training.optimizer ----------------------------------------------------------------------------------
def _trained(optimizer: str, tmp_path) -> dict[str, np.ndarray]:  # noqa: ANN001
    train, _ = load_digits(seed=0)
    trainer = ClassifierTrainer(train.subset(np.arange(200)), device=torch.device("cpu"), agent_id="a1",
                                work_dir=tmp_path / optimizer)  # fmt: skip
    task = round_task(model="mlp_digits", train=TrainSettings(epochs=1, batch_size=32, lr=0.01, optimizer=optimizer))
    torch.manual_seed(0)
    from models.weights import to_arrays
    from models.zoo import build_model

    start = to_arrays(build_model("mlp_digits", num_classes=10))
    return trainer.train(start, task).arrays


def test_adamw_trains_other_weights_than_sgd_and_a_misspelling_is_refused_by_name(tmp_path):
    sgd, adamw = _trained("sgd", tmp_path), _trained("adamw", tmp_path)
    assert _trained("sgd", tmp_path / "again").keys() == sgd.keys()
    assert all(np.array_equal(sgd[k], v) for k, v in _trained("sgd", tmp_path / "again").items())  # reproducible
    assert any(not np.allclose(sgd[k], adamw[k]) for k in sgd)
    with pytest.raises(ValueError, match="training.optimizer must be one of sgd, adamw, got 'adam'"):
        TrainSettings(optimizer="adam")
    with pytest.raises(ValueError, match="keep_momentum carries SGD's momentum"):
        TrainSettings(optimizer="adamw", keep_momentum=True)
    assert TrainSettings.from_dict({"epochs": 1}).optimizer == "sgd"  # a task from before the field: SGD
    with pytest.raises(MessageError, match="optimizer"):
        TrainSettings.from_dict({"optimizer": "Adam"})


def test_server_toml_and_the_sim_name_a_misspelled_optimizer(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=2, rounds=1, optimizer="adamw"), ("127.0.0.1", 1))
    assert load_server_config(layout.server_config).training.optimizer == "adamw"
    override_toml(layout.server_config, training={"optimizer": "adam"})
    with pytest.raises(ConfigError, match="training.optimizer must be one of sgd, adamw, got 'adam'"):
        load_server_config(layout.server_config)
    done = subprocess.run([sys.executable, "-m", "skyfed", "sim", "--optimizer", "adam", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "training.optimizer must be one of sgd, adamw, got 'adam'" in done.stderr
