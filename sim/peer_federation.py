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

from models.synthetic_detection import NAMES
from protocol.config import write_toml
from security.keys import Identity, enroll
from sim.federation import FederationLayout, SimSettings, agent_names, write_data

PEER_JOIN_WAIT_S = 3.0


def peer_plan(settings: SimSettings) -> dict:
    """``[federation]`` of every peer's agent.toml: the round plan they share. The strategy's ``threshold``
(``--strategy-option threshold=N``) is the peers' threshold (default: every peer); ``--deadline`` their
``round_timeout_s``."""
    return {
        "mode": "peer",
        "model": settings.model,
        "rounds": settings.rounds,
        "threshold": settings.strategy.get("threshold") or settings.agents,
        "round_timeout_s": settings.deadline_s,
        "join_wait_s": PEER_JOIN_WAIT_S,
        "epochs": settings.epochs,
        "batch_size": settings.batch_size,
        "lr": settings.lr,
        "momentum": settings.momentum,
        "seed": settings.seed,
        **({"classes": list(NAMES), "image_size": settings.image_size} if settings.task == "detect" else {}),
        **({"init_weights": str(Path(settings.init_weights).resolve())} if settings.init_weights else {}),
        "strategy": {k: v for k, v in settings.strategy.items() if k not in ("threshold", "elect_best")},
        "bounds": settings.bounds,
    }


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
