"""A region whose aggregator lies to its root (``skyfed sim --regions R --attack-regions K --attack KIND``).

The real region daemon (``region.daemon.Region``), enrolled at the root with its real key: its aggregator
runs honest regional rounds, and what its participant sends up is the aggregate as ``sim.attacks`` turns it
(``scale:-20+samples:1e12``: the region's step reversed and boosted, claiming most of the weight). To the
root this is an enrolled participant gone rogue, like an attacking agent; run as
``python -m sim.rogue_region --config region.toml --attack KIND``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.rogue_region", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the region's server.toml (with [upstream])")
    parser.add_argument("--attack", required=True, help="as skyfed sim --attack (not silent)")
    parser.add_argument("--attack-scope", default="parameters", choices=["parameters", "all"])
    args = parser.parse_args(argv)

    from broker_server.cli import build_server, load_checked_server_config
    from protocol.daemon import run_daemon
    from region.daemon import Region
    from sim.attacks import Attack, AttackingTrainer

    attack = Attack.parse(args.attack)

    def rogue(config):  # noqa: ANN001, ANN202 - a ServerConfig with [upstream]
        name = config.upstream.id
        return Region(config, wrap=lambda trainer: AttackingTrainer(trainer, attack, name, args.attack_scope))

    return run_daemon("server", lambda: build_server(load_checked_server_config(Path(args.config)), rogue))


if __name__ == "__main__":
    sys.exit(main())
