"""The ``skyfed`` command: one console script, each package owns its subcommand.

``skyfed agent run`` and ``skyfed server run`` are the daemons (systemd runs them), ``skyfed sim`` and
``skyfed demo`` run a whole local federation, ``skyfed monitor`` watches the status topics.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence


def configure_logging(level: str) -> None:
    """One line per event; journald adds its own timestamps, a terminal gets ours."""
    fmt = "%(levelname)s %(name)s: %(message)s"
    if sys.stderr.isatty() or os.environ.get("SKYFED_LOG_TIME"):
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr)


def stop_on_signals() -> threading.Event:
    """SIGTERM (systemd stop) and SIGINT set the returned event; daemons then shut down cleanly."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def quiet_connection_logs() -> None:
    """Interactive commands print their own output; the MQTT and broker start-up lines are noise there."""
    for name in ("skyfed.mqtt", "skyfed.sim.broker"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def run_daemon(name: str, start: Callable[[], Callable[[threading.Event], object]]) -> int:
    """Build a daemon (config errors exit 2, which systemd units treat as "do not restart"), then run it."""
    from protocol.config import ConfigError

    try:
        run = start()
    except (ConfigError, ValueError, OSError) as exc:
        logging.getLogger(f"skyfed.{name}").error("cannot start: %s", exc)
        print(f"skyfed {name}: {exc}", file=sys.stderr)
        return 2
    run(stop_on_signals())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from agent.cli import add_agent_commands
    from broker_server.cli import add_monitor_command, add_server_commands
    from security.cli import add_keys_commands
    from sim.cli import add_sim_commands

    parser = argparse.ArgumentParser(
        prog="skyfed", description="SkyFed: federated learning for drone and edge fleets over MQTT."
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True)
    add_agent_commands(commands)
    add_server_commands(commands)
    add_monitor_command(commands)
    add_sim_commands(commands)
    add_keys_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
