"""The ``[metrics]`` table both daemons share, and the Prometheus HTTP endpoint it turns on.

Each daemon keeps its gauges and counters in a ``CollectorRegistry`` of its own (never the process-wide
default one: the sim and the tests run several daemons in one process), and serves it with
``prometheus_client``'s WSGI app on a bounded server (``protocol.bounded_http``: a connection cap and an
idle timeout, so idle clients cannot fill the daemon's descriptor table) on a thread, started when the
daemon is built (a port that cannot be bound fails the start, naming the key) and shut down when it stops.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.config import ConfigError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("skyfed.metrics")

MAX_LABEL_VALUES = 32  # distinct values one label may take; later ones are counted as "other"
LABEL_VALUE = re.compile(r"[a-z][a-z0-9-]{0,47}")  # a refusal's kind as the code writes them: digest-mismatch


@dataclass(frozen=True)
class MetricsSection:
    """``[metrics]``: a Prometheus endpoint, off unless ``prometheus_port`` is set."""

    prometheus_port: int = 0  # 0: no endpoint
    # Loopback by default: the endpoint has no TLS and no authentication, and what it shows (fleet size, who
    # is online, rejection counts) is for the operator; scrape it through a local Prometheus or agent, or set
    # an address (e.g. "0.0.0.0") on a network only the monitoring stack can reach.
    prometheus_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not 0 <= self.prometheus_port <= 65535:
            raise ValueError(f"metrics.prometheus_port must be 1-65535 (0 = off), got {self.prometheus_port}")
        if not self.prometheus_host.strip():
            raise ValueError('metrics.prometheus_host must be an address to listen on, e.g. "127.0.0.1"')

    @property
    def enabled(self) -> bool:
        return self.prometheus_port != 0

    def summary(self) -> str:
        """`` prometheus=http://HOST:PORT/metrics`` for a config's one-line summary, or ``""`` when off."""
        return f" prometheus=http://{self.prometheus_host}:{self.prometheus_port}/metrics" if self.enabled else ""


class Endpoint:
    """``registry`` served over HTTP at ``section``'s address until ``close``."""

    def __init__(self, section: MetricsSection, registry: CollectorRegistry) -> None:
        from prometheus_client import make_wsgi_app  # here: a config check reads MetricsSection alone

        from protocol.bounded_http import BoundedWSGIServer

        host, port = section.prometheus_host, section.prometheus_port
        try:
            family, *_, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            self._server = BoundedWSGIServer((address[0], port), make_wsgi_app(registry), family=family)
        except OSError as exc:
            raise ConfigError(f"[metrics] cannot listen on {host}:{port} ({exc.strerror or exc}): choose a free "
                              "metrics.prometheus_port (0 = off) or another metrics.prometheus_host") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        self.port = self._server.server_address[1]
        log.info("prometheus metrics at http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve(section: MetricsSection, registry: CollectorRegistry) -> Endpoint | None:
    """The endpoint ``section`` asks for, or None when it is off."""
    return Endpoint(section, registry) if section.enabled else None


class BoundedLabel:
    """Values for one label from text others may shape (a refusal's kind): only words like the code's own,
    and at most ``limit`` distinct ones; anything else is ``other``, so a rogue sender inventing reasons
    cannot grow the endpoint (every label value is a time series a monitoring stack stores forever)."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if not LABEL_VALUE.fullmatch(value):
            return "other"
        if value in self._seen or len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return "other"
