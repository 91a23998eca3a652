"""``skyfed server run|check --config server.toml`` and ``skyfed monitor``."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from broker_server.config import ServerConfig
    from protocol.daemon import Daemon

    RegionBuilder = Callable[[ServerConfig], Daemon]


def load_checked_server_config(path: Path, *, create: bool = True) -> ServerConfig:
    """``server.toml`` parsed and its state folder writable: everything checked before the heavy imports."""
    from broker_server.config import load_server_config
    from protocol.config_check import load_checked

    return load_checked(load_server_config, path, "server.state_dir", create=create)


def build_server(config: ServerConfig, build_region: RegionBuilder, *, keep_running: bool = False,
                 again_ok: bool = True) -> Daemon:  # fmt: skip
    """The daemon ``skyfed server run`` runs (and ``skyfed.api.Server``) for a checked config: it locks the state
    folder (``again_ok``: as ``common.lock.hold_state_dir``), logs the config's warnings, and builds the aggregator,
    or a region's daemon when the config has ``[upstream]``."""
    from broker_server.config_summary import server_warnings
    from common.lock import hold_state_dir

    hold_state_dir(config.state_dir, "server.state_dir", again_ok=again_ok)  # before anything reads or writes it
    for warning in server_warnings(config):
        logging.getLogger("skyfed.server").warning("%s", warning)
    if config.upstream is not None:  # a region: the aggregator and its participant at the root
        return build_region(config)
    from broker_server.daemon import Aggregator  # PyTorch: seconds, so only once the config is known good

    return Aggregator(config, keep_running=keep_running)


def run_server(args: argparse.Namespace) -> int:
    from protocol.daemon import run_daemon

    def build() -> Daemon:
        config = load_checked_server_config(Path(args.config))
        return build_server(config, args.build_region, keep_running=args.keep_running)

    return run_daemon("server", build)


def check_server(args: argparse.Namespace) -> int:
    """``skyfed server check``: exit 0 with ``ok: ...`` (and any warnings), or 2 with the error naming the key."""
    from broker_server.config_summary import server_summary, server_warnings
    from protocol.config_check import report_check

    return report_check("skyfed server check", lambda: load_checked_server_config(Path(args.config), create=False),
                        lambda config: f"{args.config}: {server_summary(config)}", server_warnings)  # fmt: skip


def run_monitor(args: argparse.Namespace) -> int:
    from broker_server.watch.monitor import monitor
    from protocol.daemon import quiet_connection_logs
    from protocol.mqtt import BrokerSettings, TlsSettings

    quiet_connection_logs()
    tls = None
    if args.cafile:
        tls = TlsSettings(args.cafile, args.cert, args.key)
    elif args.cert or args.key:
        print("skyfed monitor: --cert and --key need --cafile (the federation CA, e.g. DIR/monitor/ca.crt)")
        return 2
    # MQTT 5, so that a broker closing us for another client with the same id says so (3.1.1 cannot);
    # the monitor falls back to 3.1.1 on a broker that refuses 5 (NATS)
    try:
        settings = BrokerSettings.from_address(args.broker, tls=tls, protocol="5")
    except ValueError as exc:
        print(f"skyfed monitor: --broker: {exc}")
        return 2
    return monitor(settings, args.federation, once=args.once, timeout_s=args.timeout)


def add_server_commands(commands: argparse._SubParsersAction, build_region: RegionBuilder) -> None:
    """``skyfed server``; ``build_region`` makes a region's daemon (``[upstream]``), from the layer above this one."""
    server = commands.add_parser("server", help="the aggregator daemon").add_subparsers(dest="action", required=True)
    run = server.add_parser("run", help="run the aggregator (systemd runs this)")
    run.add_argument("--config", required=True, help="path to server.toml")
    run.add_argument("--keep-running", action="store_true", help="stay up after server.rounds are done (serve status)")
    run.set_defaults(handler=run_server, build_region=build_region)
    check = server.add_parser("check", help="check server.toml (and that state_dir is writable) without starting")
    check.add_argument("--config", required=True, help="path to server.toml")
    check.set_defaults(handler=check_server)


def add_monitor_command(commands: argparse._SubParsersAction) -> None:
    mon = commands.add_parser("monitor", help="live view of server and agents from the status topics")
    mon.add_argument("--broker", default="127.0.0.1:1883",
                     help="HOST:PORT of the MQTT broker (a cluster: its nodes, comma-separated)")  # fmt: skip
    mon.add_argument("--federation", default="demo")
    mon.add_argument("--once", action="store_true", help="print one snapshot and exit")
    mon.add_argument("--timeout", type=float, default=3.0,
                     help="seconds to collect retained status; a federation with none by then exits 1")  # fmt: skip
    mon.add_argument("--cafile", help="TLS: the federation CA (skyfed provision's DIR/monitor/ca.crt)")
    mon.add_argument("--cert", help="TLS: the monitoring certificate (DIR/monitor/monitor.crt)")
    mon.add_argument("--key", help="TLS: its key (DIR/monitor/monitor.crt.key)")
    mon.set_defaults(handler=run_monitor)
