"""``skyfed agent run --config agent.toml``."""

from __future__ import annotations

import argparse
from pathlib import Path


def run_agent(args: argparse.Namespace) -> int:
    from agent.config import load_agent_config
    from agent.daemon import EdgeAgent
    from protocol.daemon import run_daemon

    return run_daemon("agent", lambda: EdgeAgent(load_agent_config(Path(args.config))))


def add_agent_commands(commands: argparse._SubParsersAction) -> None:
    agent = commands.add_parser("agent", help="the edge agent daemon").add_subparsers(dest="action", required=True)
    run = agent.add_parser("run", help="run the agent (systemd runs this)")
    run.add_argument("--config", required=True, help="path to agent.toml")
    run.set_defaults(handler=run_agent)
