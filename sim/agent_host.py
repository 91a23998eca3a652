"""``python -m sim.agent_host --config A.toml --config B.toml …``: several agents in one OS process.

For simulations of many agents (``skyfed sim --agents-per-process K``): each agent is exactly the
daemon ``skyfed agent run`` starts — its own MQTT connection and client id, keys, state folder and
durable progress — running its loop on a thread of its own, so only the process and its PyTorch
(about 370 MB of private memory per process) are shared. ``--attacker CONFIG`` adds an agent whose
trainer attacks (``sim.attack_agent``). SIGTERM stops every agent cleanly (each publishes its final
status); log lines carry the agent id as the thread name. Deployments run one agent per process.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from agent.config import load_agent_config
from agent.daemon import EdgeAgent
from protocol.daemon import configure_logging, stop_on_signals
from sim import attack_agent
from sim.attacks import SCOPES, Attack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.agent_host", description=__doc__)
    parser.add_argument("--config", action="append", default=[], help="an agent.toml (repeatable)")
    parser.add_argument("--attacker", action="append", default=[], help="an agent.toml whose agent attacks")
    parser.add_argument("--attack", default="", help="sign-flip | scale:F | noise:SIGMA | samples:N")
    parser.add_argument("--scope", default="parameters", choices=SCOPES)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, thread_names=True)
    try:
        agents = [EdgeAgent(load_agent_config(Path(path))) for path in args.config]
        if args.attacker:
            attack = Attack.parse(args.attack)
            agents += [attack_agent.build(Path(path), attack, args.scope) for path in args.attacker]
    except (ValueError, OSError) as exc:  # a bad config (ConfigError is a ValueError) or an unreadable file
        print(f"sim.agent_host: cannot start: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    threads = [threading.Thread(target=agent.run, args=(stop,), name=agent.id) for agent in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
