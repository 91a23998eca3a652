"""The ``skyfed`` command: one console script, each package owns its subcommand.

``skyfed agent run`` and ``skyfed server run`` are the daemons (systemd runs them), ``skyfed sim`` and
``skyfed demo`` run a whole local federation, ``skyfed monitor`` watches the status topics, ``skyfed
provision`` writes every key, certificate and broker file of a federation. ``python -m skyfed`` is the same
command (``__main__``); ``skyfed.api`` is the Python API over the same daemons and sim.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from agent.cli import add_agent_commands
    from broker_server.cli import add_monitor_command, add_server_commands
    from broker_server.watch.dashboard.cli import add_dashboard_command
    from provisioning.cli import add_provision_command
    from provisioning.keys_cli import add_certs_commands, add_keys_commands
    from region.cli import build_region
    from sim.cli import add_sim_commands
    from sim.data_cli import add_data_commands

    parser = argparse.ArgumentParser(
        prog="skyfed", description="SkyFed: federated learning for drone and edge fleets over MQTT."
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True)
    add_agent_commands(commands)
    add_server_commands(commands, build_region)
    add_monitor_command(commands)
    add_dashboard_command(commands)
    add_sim_commands(commands)
    add_data_commands(commands)
    add_keys_commands(commands)
    add_certs_commands(commands)
    add_provision_command(commands)
    return parser


def legacy_spelling(argv: list[str]) -> list[str]:
    """``skyfed data AGENT…`` (before ``data`` had subcommands) means ``skyfed data digits AGENT…``."""
    from sim.data_cli import subcommands

    if len(argv) > 1 and argv[0] == "data" and argv[1] not in subcommands() and not argv[1].startswith("-"):
        return ["data", "digits", *argv[1:]]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    from protocol.daemon import configure_logging

    args = build_parser().parse_args(legacy_spelling(sys.argv[1:] if argv is None else list(argv)))
    configure_logging(args.log_level)
    return int(args.handler(args) or 0)
