"""Lay out a peer-mode federation on disk (``skyfed sim --mode peer``): no server, and per peer

    <root>/<peer>/agent.toml ([federation] mode = "peer" and the round plan), <peer>.key,
                  enrolled/<every peer>.pub, data.npz, test.npz (its local validation split)
                  (detect: data/data.yaml, whose val split is its local validation split)

the same files ``skyfed provision --mode peer`` writes for a real fleet, so ``skyfed agent run --config
<root>/<peer>/agent.toml`` runs each peer exactly as deployed. The data are the centralized sim's for the
same settings (``sim.federation.write_data``), its evaluation set under ``<root>/server/`` included: there
``sim.peer_run`` scores the elected model, so the two modes compare.
"""

from __future__ import annotations

from pathlib import Path

from protocol.config import write_toml
from security.keys import Identity, enroll
from sim.federation import FederationLayout, agent_names, write_data
from sim.settings import SimSettings, peer_plan


def create_peer_federation(root: Path, settings: SimSettings, broker: tuple[str, int]) -> FederationLayout:
    """Write everything ``settings.agents`` peers need under ``root``."""
    names = agent_names(settings.agents)
    _, agent_data, description = write_data(root, settings)
    trainer = "detector" if settings.task == "detect" else "classifier"
    identities = {name: Identity.generate(name) for name in names}
    configs = {}
    for name, identity in identities.items():
        folder = root / name
        identity.save(folder)
        for other in identities.values():
            enroll(folder / "enrolled", other.public)
        write_toml(folder / "agent.toml", {
            "agent": {"id": name, "federation": settings.federation, "state_dir": "state", **agent_data,
                      "seed": settings.seed},
            "broker": {"host": broker[0], "port": broker[1]},
            "keys": {"identity": f"{name}.key", "enrolled": "enrolled"},
            "training": {"trainer": trainer, "threads": 1,
                         **({"worker": settings.worker} if settings.worker != "deployed" else {})},
            "federation": peer_plan(settings),
        })  # fmt: skip
        configs[name] = folder / "agent.toml"
    return FederationLayout(root, root / "server" / "none", configs, description)
