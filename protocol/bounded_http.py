"""The HTTP server behind a monitoring endpoint: a bounded number of connections, each dropped when idle.

prometheus-client's own server starts a thread per connection and waits on each without a timeout: 1,022
idle TCP connections to it filled a server's 1,024-descriptor table, and the round stalled on ``Too many
open files`` elsewhere in the process. Here at most ``max_connections`` are served at a time, each on a
thread of its own; one more is closed as soon as it is accepted, and a client silent for ``idle_s`` (no
request yet, or not reading the response) is dropped. So the endpoint holds two descriptors more than
``max_connections`` at most (the listening socket, one being refused), whoever connects. A table full for
other reasons pauses the accept loop instead of spinning it (the listening socket stays readable while
``accept`` fails).
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from common.logs import Throttle

MAX_CONNECTIONS = 32  # a few Prometheus servers and an operator's curl; a scrape is one short connection
IDLE_TIMEOUT_S = 10.0  # Prometheus' default scrape_timeout: a scraper never waits longer on one step
FULL_TABLE_PAUSE_S = 0.1
log = logging.getLogger("skyfed.metrics")


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = self.server.idle_s  # StreamRequestHandler puts it on the connection
        super().setup()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class names it so
        """Scrapes are not logged: one line every 15 s per scraper would bury the daemon's own lines."""


class BoundedWSGIServer(ThreadingMixIn, WSGIServer):
    """``app`` served on ``address`` by ``serve_forever``, at most ``max_connections`` clients at a time."""

    daemon_threads = True  # a slow client never holds up a daemon's stop
    block_on_close = False
    request_queue_size = 64  # a burst of connections waits for accept instead of retrying SYNs

    def __init__(self, address: tuple[str, int], app: Callable, *, family: socket.AddressFamily = socket.AF_INET,
                 max_connections: int = MAX_CONNECTIONS, idle_s: float = IDLE_TIMEOUT_S) -> None:  # fmt: skip
        self.address_family = family
        self.idle_s = idle_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max = max_connections
        self._log = Throttle()
        super().__init__(address, _Handler)
        self.set_app(app)

    def get_request(self) -> tuple[socket.socket, object]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._warn("full", "metrics endpoint cannot accept a connection: %s; pausing %.1f s", exc.strerror,
                           FULL_TABLE_PAUSE_S)  # fmt: skip
                time.sleep(FULL_TABLE_PAUSE_S)
            raise

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self._warn("busy", "metrics endpoint has %d connections open: closed a new one from %s", self._max,
                       client_address)  # fmt: skip
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread, which frees the slot when it ends
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: socket.socket, client_address: object) -> None:
        """A client that went silent or away is dropped quietly; anything else is one line, not a traceback."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            log.warning("metrics endpoint failed a request from %s: %r", client_address, exc)

    def _warn(self, key: str, message: str, *args: object) -> None:
        held = self._log.allow(key)
        if held is not None:
            log.warning(message + " held_back=%d", *args, held)
