"""``python -m sim.attack_agent --config agent.toml --attack KIND``: a malicious agent for experiments.

The same daemon as ``skyfed agent run`` with its trainer wrapped by ``sim.attacks.AttackingTrainer``;
``skyfed sim --attackers K`` starts K of these. Not part of the ``skyfed`` command on purpose.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.config import load_agent_config
from agent.daemon import EdgeAgent
from protocol.daemon import configure_logging, run_daemon
from sim.attacks import SCOPES, Attack, AttackingTrainer


def build(config_path: Path, attack: Attack, scope: str) -> EdgeAgent:
    agent = EdgeAgent(load_agent_config(config_path))
    agent.trainer = AttackingTrainer(agent.trainer, attack, agent.id, scope)
    return agent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.attack_agent", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--attack", required=True, help="sign-flip | scale:F | noise:SIGMA | samples:N")
    parser.add_argument("--scope", default="parameters", choices=SCOPES, help="what the attack changes")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    attack = Attack.parse(args.attack)
    return run_daemon("agent", lambda: build(Path(args.config), attack, args.scope))


if __name__ == "__main__":
    sys.exit(main())
