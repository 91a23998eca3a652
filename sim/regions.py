"""Lay out a federation of regions (``skyfed sim --regions R``): a root server whose participants are R regional
aggregators, each with its own broker (bridged to the root's), federation, key and agents.

    <root>/server/            the root: server.toml, enrolled/region-<k>.pub, test.npz
    <root>/region-<k>/        a region's aggregator: server.toml with [upstream], server.key, enrolled/<agent>.pub,
                              region-<k>.key (its participant at the root), root.pub
    <root>/<agent>/           as in a flat federation, pointing at its region's broker, federation and key

The agents, their data and their training are those of the flat federation of the same settings
(``sim.federation.create_federation``): agent k of a flat run is agent k of a two-level run, which is what
makes the two comparable (docs/results/scale.md).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from protocol.config import read_toml, write_toml
from security.keys import Identity, PublicIdentity, enroll
from sim.availability import round_sizes
from sim.federation import FederationLayout, SimSettings, create_federation

ROOT_DEADLINE_FACTOR = 2.0  # the root waits for a whole regional round: more than a regional deadline


@dataclass(frozen=True)
class RegionLayout:
    flat: FederationLayout  # the root server's config and every agent's
    regions: dict[str, Path]  # region id -> its aggregator's server.toml
    members: dict[str, list[str]]  # region id -> its agents


def region_names(count: int) -> list[str]:
    return [f"region-{k}" for k in range(1, count + 1)]


def split_agents(agents: list[str], regions: int) -> dict[str, list[str]]:
    """Consecutive, near-equal groups of agents, one per region."""
    bounds = [round(k * len(agents) / regions) for k in range(regions + 1)]
    return {name: agents[bounds[k] : bounds[k + 1]] for k, name in enumerate(region_names(regions))}


def create_regions(root: Path, settings: SimSettings, root_broker: tuple[str, int],
                   region_brokers: list[tuple[str, int]]) -> RegionLayout:  # fmt: skip
    """Write the flat federation, then move its agents into regions under the root."""
    flat = create_federation(root, settings, root_broker)
    server_dir = root / "server"
    members = split_agents(list(flat.agent_configs), settings.regions)
    root_key = PublicIdentity.load(server_dir / "server.pub")
    for agent in flat.agent_configs:
        (server_dir / "enrolled" / f"{agent}.pub").unlink()  # the root's participants are the regions
    root_config = read_toml(flat.server_config)
    regions = {}
    for (region, agents), (host, port) in zip(members.items(), region_brokers, strict=True):
        regions[region] = _region_node(root / region, region, agents, root_config, (host, port), flat, settings)
        participant = Identity.generate(region)
        participant.save(root / region)
        enroll(server_dir / "enrolled", participant.public)
        root_key.save(root / region / "root.pub")
    root_config["rounds"] |= {"min_agents": settings.regions, "quorum": max(1, settings.regions // 2),
                              "deadline_s": ROOT_DEADLINE_FACTOR * settings.deadline_s + 30}  # fmt: skip
    write_toml(flat.server_config, root_config)
    return RegionLayout(flat, regions, members)


def _region_node(directory: Path, region: str, agents: list[str], root_config: dict, broker: tuple[str, int],
                 flat: FederationLayout, settings: SimSettings) -> Path:  # fmt: skip
    """A region's aggregator (its own federation and key, its agents enrolled) and its agents moved to it."""
    federation = f"{settings.federation}-{region}"
    identity = Identity.generate("server")
    (directory / "enrolled").mkdir(parents=True, exist_ok=True)
    identity.save(directory)
    broker_table = {"host": broker[0], "port": broker[1]}
    selected = max(1, math.ceil(settings.fraction * len(agents)))
    config = {key: dict(value) for key, value in root_config.items() if key not in ("pool", "metrics")}  # root's
    config["server"] |= {"federation": federation, "rounds": 0, "eval_data": str(flat.root / "server" / "test.npz")}
    config["broker"] = broker_table
    config["rounds"] |= round_sizes(settings.availability, agents, selected)
    config["upstream"] = {"id": region, "federation": settings.federation, "identity": f"{region}.key",
                          "server": "root.pub"}  # fmt: skip
    write_toml(directory / "server.toml", config)
    for agent in agents:
        agent_dir = flat.agent_configs[agent].parent
        enroll(directory / "enrolled", PublicIdentity.load(agent_dir / f"{agent}.pub"))
        shutil.copy(directory / "server.pub", agent_dir / "server.pub")
        agent_config = read_toml(flat.agent_configs[agent])
        agent_config["agent"]["federation"] = federation
        agent_config["broker"] = broker_table
        write_toml(flat.agent_configs[agent], agent_config)
    return directory / "server.toml"
