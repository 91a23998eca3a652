"""``skyfed agent run --config agent.toml``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from protocol.config import ConfigError


def run_agent(args: argparse.Namespace) -> int:
    from agent.config import load_agent_config
    from agent.daemon import EdgeAgent
    from skyfed import stop_on_signals

    try:
        config = load_agent_config(Path(args.config))
        agent = EdgeAgent(config)
    except (ConfigError, ValueError, OSError) as exc:
        logging.getLogger("skyfed.agent").error("cannot start: %s", exc)
        print(f"skyfed agent: {exc}", file=sys.stderr)
        return 2
    agent.run(stop_on_signals())
    return 0


def add_agent_commands(commands: argparse._SubParsersAction) -> None:
    agent = commands.add_parser("agent", help="the edge agent daemon").add_subparsers(dest="action", required=True)
    run = agent.add_parser("run", help="run the agent (systemd runs this)")
    run.add_argument("--config", required=True, help="path to agent.toml")
    run.set_defaults(handler=run_agent)
