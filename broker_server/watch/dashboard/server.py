"""The dashboard's HTTP side: the static page, its vendored libraries, and a generated ``config.js``.

The Python process never touches MQTT: the browser connects to the broker's WebSockets listener itself and
subscribes to status, metrics and history topics only. This server hands out files from ``static/`` (no
directory listings) and ``config.js``, which tells the page where the broker is and which federation to show.
A peer federation's page reads its peers' ``member``, ``metrics`` and ``best`` instead (``static/peers.js``).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from dataclasses import asdict, dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

from protocol.messages import HEADLINE
from protocol.scores import LABELS
from protocol.topics import Topics

log = logging.getLogger("skyfed.dashboard")

STATIC = Path(__file__).resolve().parent / "static"
# the page's own files and the broker's WebSockets listener, nothing else (the libraries are vendored); MQTT.js
# runs its keepalive timer in a worker it starts from a blob: URL (a background tab throttles a page's own
# timers until the broker drops the connection), so blob: workers, and nothing else, are allowed too
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; connect-src ws: wss:; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; worker-src blob:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# every file in static/ has a name like this; anything else (a NUL byte, a control character, '..', a name that
# is not UTF-8) is answered 400 before it reaches open(), which raises on a NUL byte
SAFE_PATH = re.compile(r"/(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}/?){0,4}")


@dataclass(frozen=True)
class PageConfig:
    """What the page needs to connect: served as ``config.js``. ``ws_host`` empty: the page's own host."""

    federation: str
    ws_port: int
    ws_host: str = ""
    ws_path: str = "/mqtt"
    tls: bool = False  # wss://: the broker's WebSockets listener has a certificate the browser trusts

    def __post_init__(self) -> None:
        Topics(self.federation)  # a valid topic level, or ValueError naming it
        if not 0 < self.ws_port < 65536:
            raise ValueError(f"--ws-port must be 1-65535, got {self.ws_port}")
        if not self.ws_path.startswith("/"):
            raise ValueError(f"--ws-path must start with '/', got {self.ws_path!r}")

    def script(self) -> bytes:
        """Also the keys a peer's round is led by, with their labels: the page names them as every surface does."""
        page = {**asdict(self), "peer_scores": [[key, LABELS[key]] for key in HEADLINE]}
        return f"window.SKYFED_DASHBOARD = {json.dumps(page)};\n".encode()


class DashboardHandler(SimpleHTTPRequestHandler):
    def __init__(self, *args: object, page: PageConfig, **kwargs: object) -> None:
        self.page = page
        super().__init__(*args, directory=str(STATIC), **kwargs)  # type: ignore[misc]

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] == "/config.js":
            body = self.page.script()
            self.send_response(200)
            self.send_header("Content-Type", "text/javascript; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def send_head(self):  # noqa: ANN201 - http.server's signature; GET and HEAD both come here
        path = unquote(self.path.split("?", 1)[0].split("#", 1)[0], errors="replace")
        if not SAFE_PATH.fullmatch(path):
            self.server.bad_paths += 1  # type: ignore[attr-defined]  # a PageHttpServer
            log.info("event=dashboard-bad-path client=%s path=%.80r", self.client_address[0], self.path)
            self.send_error(400, "bad path")
            return None
        return super().send_head()

    def list_directory(self, path: str):  # noqa: ANN201 - no directory listings
        self.send_error(404, "not found")
        return None

    def end_headers(self) -> None:
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        super().end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        log.debug("event=dashboard-request client=%s %s", self.client_address[0], format % args)


class PageHttpServer(ThreadingHTTPServer):
    daemon_threads = True
    bad_paths = 0  # requests answered 400 (see SAFE_PATH)

    def handle_error(self, request: object, client_address: tuple) -> None:
        """One log line, not socketserver's traceback on stderr: a client that breaks one request is not news."""
        log.warning("event=dashboard-request-failed client=%s error=%r", client_address[0], sys.exc_info()[1])


class DashboardServer:
    """``ThreadingHTTPServer`` on ``host:port`` (port 0: a free one) serving the page, on a thread of its own."""

    def __init__(self, page: PageConfig, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.page = page
        self.httpd = PageHttpServer((host, port), partial(DashboardHandler, page=page))
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dashboard-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> DashboardServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)
