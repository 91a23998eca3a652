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


def _agent(commands: argparse._SubParsersAction) -> None:
    from agent.cli import add_agent_commands

    add_agent_commands(commands)


def _server(commands: argparse._SubParsersAction) -> None:
    from broker_server.cli import add_monitor_command, add_server_commands
    from region.cli import build_region

    add_server_commands(commands, build_region)
    add_monitor_command(commands)


def _dashboard(commands: argparse._SubParsersAction) -> None:
    from broker_server.watch.dashboard.cli import add_dashboard_command

    add_dashboard_command(commands)


def _sim(commands: argparse._SubParsersAction) -> None:
    from sim.cli import add_sim_commands
    from sim.data_cli import add_data_commands

    add_sim_commands(commands)
    add_data_commands(commands)


def _provisioning(commands: argparse._SubParsersAction) -> None:
    from provisioning.cli import add_provision_command
    from provisioning.keys_cli import add_certs_commands, add_keys_commands

    add_keys_commands(commands)
    add_certs_commands(commands)
    add_provision_command(commands)


# Each adds its packages' subcommands, the daemons' first: ``skyfed server check`` builds only as much of the
# parser as defines ``server``, so a config check imports no other package's command line (measured 0.14 s).
ADDERS = (_agent, _server, _dashboard, _sim, _provisioning)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; with ``command``, only as far as the subcommands that define it."""
    parser = argparse.ArgumentParser(
        prog="skyfed", description="SkyFed: federated learning for drone and edge fleets over MQTT."
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True)
    for add in ADDERS:
        add(commands)
        if command in commands.choices:
            break
    return parser


def first_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (the first word that is not an option or --log-level's value); None when help
    is asked for before it, so the help lists every command."""
    words = iter(argv)
    for word in words:
        if word in ("-h", "--help"):
            return None
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def legacy_spelling(argv: list[str]) -> list[str]:
    """``skyfed data AGENT…`` (before ``data`` had subcommands) means ``skyfed data digits AGENT…``."""
    if len(argv) < 2 or argv[0] != "data" or argv[1].startswith("-"):
        return argv
    from sim.data_cli import subcommands

    return argv if argv[1] in subcommands() else ["data", "digits", *argv[1:]]


def main(argv: Sequence[str] | None = None) -> int:
    from common.logs import configure_logging

    words = legacy_spelling(sys.argv[1:] if argv is None else list(argv))
    args = build_parser(first_command(words)).parse_args(words)
    configure_logging(args.log_level)
    return int(args.handler(args) or 0)
