"""Lay out a local federation on disk: keys, enrolment, partitioned data and one config per node.

The same files a real deployment has (deploy/examples/), generated for N agents in one folder:

    <root>/server/server.toml, server.key, enrolled/<agent>.pub, test.npz (detect: eval/data.yaml)
    <root>/<agent>/agent.toml, <agent>.key, server.pub, data.npz, test.npz (detect: data/data.yaml)

so ``skyfed server run --config <root>/server/server.toml`` works on it exactly as in production.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.datasets import load_npz
from models.own import is_reference
from protocol.config import write_toml
from security.keys import Identity, enroll
from sim.availability import describe, gate_table, round_sizes
from sim.classify_layout import POOL_FILE, Sharing, describe_partition, write_classify_data
from sim.nats_cluster import spread_broker_table
from sim.scale import agents_export_onnx, server_status_interval_s, status_interval_s
from sim.settings import SimSettings, agent_names


@dataclass(frozen=True)
class FederationLayout:
    root: Path
    server_config: Path
    agent_configs: dict[str, Path]
    description: list[str]  # one line per agent: what data it holds


def node_names(settings: SimSettings) -> list[str]:
    """The agents that run: one per share of the data, or one holding it all (``pooled``)."""
    return agent_names(1 if settings.pooled else settings.running_agents)


def write_data(root: Path, settings: SimSettings) -> tuple[dict, dict, list[str]]:
    """The data of the federation's task; returns the server's and the agents' data settings and a
    description of what each agent holds."""
    names = agent_names(settings.agents)
    if settings.task == "detect":
        from models.synthetic_detection import NAMES
        from sim.detection_data import describe_mixes, pool, write_detection_data

        mixes, density = write_detection_data(root / "pool" if settings.pooled else root, names, settings.partition,
                                              settings.seed, images=settings.images_per_agent,
                                              image_size=settings.image_size,
                                              density_skew=settings.density_skew)  # fmt: skip
        server = {
            "eval_data": "eval/data.yaml",
            "classes": list(NAMES),
            "share": settings.share,
            **({"init_weights": str(Path(settings.init_weights).resolve())} if settings.init_weights else {}),
        }
        description = describe_mixes(mixes, density, names)
        if settings.pooled:
            (root / "server").mkdir(parents=True, exist_ok=True)
            (root / "pool" / "server" / "eval").rename(root / "server" / "eval")
            pool([root / "pool" / n / "data" / "data.yaml" for n in names], root / node_names(settings)[0] / "data")
            description = [f"{node_names(settings)[0]}: the union of " + "; ".join(description)]
        return server, {"data": "data/data.yaml"}, description
    names = node_names(settings)
    sharing = Sharing(settings.agents, settings.share_ratio, settings.share_mode)
    train, test, domains = write_classify_data(root, names, settings.partition, settings.seed, settings.dataset,
                                               sharing=sharing)  # fmt: skip
    agent = {"data": "data.npz", "test_data": "test.npz"}
    description = describe_partition(train, test, names, domains)
    if not (root / "server" / POOL_FILE).exists():
        return {"eval_data": "test.npz"}, agent, description
    shared = load_npz(root / "server" / POOL_FILE)
    labels = ",".join(str(label) for label in np.unique(shared.y))
    description.append(f"server-pool: {len(shared)} samples, labels {labels} ({settings.share_mode}, share ratio "
                       f"{settings.share_ratio:g} of {settings.agents} agents' data)")  # fmt: skip
    return {"eval_data": "test.npz", "pool": POOL_FILE}, agent, description


def create_federation(
    root: Path, settings: SimSettings, broker: tuple[str, int], *, cluster: list[str] | None = None
) -> FederationLayout:
    """Write everything a federation of ``settings.agents`` agents needs under ``root``; with a ``cluster`` (its
    nodes' HOST:PORT) the server and the agents connect to its nodes in turn, each with the others as fallbacks."""
    server_data, agent_data, description = write_data(root, settings)
    description += describe(settings.availability, node_names(settings), settings.asynchronous)
    if settings.asynchronous:
        description.append(f"rounds: asynchronous (FedBuff), a model version every {settings.buffer} updates, "
                           f"staleness {settings.staleness}, at most {settings.max_staleness} versions behind")
    origin = time.time()  # the fleet's time zero for an availability trace
    pool_data = server_data.pop("pool", None)  # [pool] data: the server's shared pool, when the sim carved one
    trainer = "detector" if settings.task == "detect" else "classifier"
    nodes = cluster or [f"{broker[0]}:{broker[1]}"]
    selected = max(1, math.ceil(settings.fraction * len(node_names(settings))))  # a round's agents

    server_dir = root / "server"
    (server_dir / "enrolled").mkdir(parents=True, exist_ok=True)
    server_identity = Identity.generate("server")
    server_identity.save(server_dir)
    write_toml(
        server_dir / "server.toml",
        {
            "server": {
                "federation": settings.federation,
                "state_dir": "state",
                "model": settings.model,
                "rounds": settings.rounds,
                **server_data,
                "seed": settings.seed,
                "status_interval_s": server_status_interval_s(len(node_names(settings))),
                "codec": settings.codec,
                **({} if settings.score_trained is None else {"score_trained": settings.score_trained}),
                "score_start": settings.score_start,
            },
            "broker": spread_broker_table(nodes, 0),
            "keys": {"identity": "server.key", "enrolled": "enrolled"},
            "rounds": {
                "fraction": settings.fraction,
                **round_sizes(settings.availability, node_names(settings), selected),  # the run starts once
                # all (unless --fraction or --availability) are online
                "deadline_s": settings.deadline_s,
                **({"mode": "async", **settings.async_table()} if settings.asynchronous else {}),
            },
            "training": {
                "epochs": settings.epochs,
                "batch_size": settings.batch_size,
                "lr": settings.lr,
                "momentum": settings.momentum,
                "keep_momentum": settings.keep_momentum,
                "optimizer": settings.optimizer,
                **({"image_size": settings.image_size} if settings.task == "detect" else {}),
            },
            "strategy": settings.strategy,
            "bounds": settings.bounds,
            "privacy": settings.privacy,
            **({"pool": {"data": pool_data}} if pool_data else {}),
            **({"metrics": {"prometheus_port": settings.prometheus_port}} if settings.prometheus_port else {}),
        },
    )
    agent_configs: dict[str, Path] = {}
    heartbeat_s = status_interval_s(len(node_names(settings)))
    export_onnx = agents_export_onnx(len(node_names(settings)))
    for k, name in enumerate(node_names(settings), start=1):
        agent_dir = root / name
        identity = Identity.generate(name)
        identity.save(agent_dir)
        enroll(server_dir / "enrolled", identity.public)
        server_identity.public.save(agent_dir / "server.pub")
        write_toml(
            agent_dir / "agent.toml",
            {
                "agent": {
                    "id": name,
                    "federation": settings.federation,
                    "state_dir": "state",
                    **agent_data,
                    "seed": settings.seed,
                    "status_interval_s": heartbeat_s,
                },
                "broker": spread_broker_table(nodes, k),
                "keys": {"identity": f"{name}.key", "server": "server.pub"},
                "training": {"trainer": trainer, "threads": 1, "onnx": export_onnx,
                             **({"model": settings.model} if is_reference(settings.model) else {}),
                             **({"worker": settings.worker} if settings.worker != "deployed" else {})},
                "privacy": settings.local_privacy,
                **gate_table(settings.availability, origin),
            },
        )
        agent_configs[name] = agent_dir / "agent.toml"
    return FederationLayout(root, server_dir / "server.toml", agent_configs, description)
