"""``skyfed dashboard``: serve the live page until stopped (SIGTERM or Ctrl-C)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from broker_server.dashboard.server import DashboardServer, PageConfig

log = logging.getLogger("skyfed.dashboard")


def broker_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--broker must be HOST:PORT, got {value!r}")
    return host, int(port)


def run_dashboard(args: argparse.Namespace) -> int:
    broker_host, broker_port = args.broker
    page = PageConfig(federation=args.federation, ws_port=args.ws_port, ws_host=args.ws_host or broker_host,
                      ws_path=args.ws_path, tls=args.tls)  # fmt: skip
    server = DashboardServer(page, host=args.host, port=args.port).start()
    scheme = "wss" if page.tls else "ws"
    log.info("event=dashboard-started url=%s federation=%s broker=%s:%d websockets=%s://%s:%d%s", server.url,
             page.federation, broker_host, broker_port, scheme, page.ws_host, page.ws_port, page.ws_path)  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.stop()
    log.info("event=dashboard-stopped")
    return 0


def add_dashboard_command(commands: argparse._SubParsersAction) -> None:
    dash = commands.add_parser("dashboard", help="serve a live web page of a federation (MQTT over WebSockets)")
    dash.add_argument("--broker", type=broker_host_port, default=("127.0.0.1", 1883),
                      help="HOST:PORT of the MQTT broker; the page connects to HOST's WebSockets listener")  # fmt: skip
    dash.add_argument("--ws-port", type=int, required=True, help="the broker's MQTT-over-WebSockets port")
    dash.add_argument("--ws-host", default="", help="host the browser reaches the broker at (default: --broker's)")
    dash.add_argument("--ws-path", default="/mqtt", help="WebSockets path (mosquitto accepts any)")
    dash.add_argument("--tls", action="store_true", help="wss://: the WebSockets listener has TLS")
    dash.add_argument("--federation", required=True)
    dash.add_argument("--host", default="127.0.0.1", help="address the page is served on (default loopback)")
    dash.add_argument("--port", type=int, default=8080, help="HTTP port of the page")
    dash.set_defaults(handler=run_dashboard)
