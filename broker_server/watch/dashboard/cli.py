"""``skyfed dashboard``: serve the live page until stopped (SIGTERM or Ctrl-C)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

log = logging.getLogger("skyfed.dashboard")
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def broker_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--broker must be HOST:PORT, got {value!r}")
    return host, int(port)


def browser_host(broker_host: str) -> str:
    """Where the browser finds the broker: a loopback broker is on the page's own host (empty: the page uses
    its address bar's host), since the browser may be on another machine than the dashboard."""
    return "" if broker_host in LOOPBACK else broker_host


def run_dashboard(args: argparse.Namespace) -> int:
    from broker_server.watch.dashboard.server import DashboardServer, PageConfig  # not for other commands' start

    broker_host, broker_port = args.broker
    stop = threading.Event()  # set by SIGTERM from before the page is served: a stop that comes at once is clean
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        page = PageConfig(federation=args.federation, ws_port=args.ws_port, ws_path=args.ws_path, tls=args.tls,
                          ws_host=args.ws_host or browser_host(broker_host))  # fmt: skip
        server = DashboardServer(page, host=args.host, port=args.port).start()
    except ValueError as exc:  # a bad flag: restarting cannot fix it (the unit's RestartPreventExitStatus=2)
        print(f"skyfed dashboard: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"skyfed dashboard: cannot serve on {args.host}:{args.port}: {exc} (--host/--port)", file=sys.stderr)
        return 1
    scheme, ws_host = "wss" if page.tls else "ws", page.ws_host or "<page host>"
    log.info("event=dashboard-started url=%s federation=%s broker=%s:%d websockets=%s://%s:%d%s", server.url,
             page.federation, broker_host, broker_port, scheme, ws_host, page.ws_port, page.ws_path)  # fmt: skip
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
    dash.add_argument("--ws-host", default="",
                      help="host the browser reaches the broker at (default: --broker's HOST; "
                           "for a loopback broker, the host in the page's address bar)")  # fmt: skip
    dash.add_argument("--ws-path", default="/mqtt", help="WebSockets path the page requests (default /mqtt)")
    dash.add_argument("--tls", action="store_true", help="wss://: the WebSockets listener has TLS")
    dash.add_argument("--federation", required=True)
    dash.add_argument("--host", default="127.0.0.1", help="address the page is served on (default loopback)")
    dash.add_argument("--port", type=int, default=8080, help="HTTP port of the page")
    dash.set_defaults(handler=run_dashboard)
