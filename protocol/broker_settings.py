"""Where and how an MQTT client connects (the ``[broker]`` section): plain settings that the client
(``protocol.mqtt``) and its error texts (``protocol.mqtt_problems``) both read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TlsSettings:
    """Client TLS: the CA that signed the broker, and this node's certificate and key (mutual TLS)."""

    ca_certs: str
    certfile: str | None = None
    keyfile: str | None = None


def parse_address(address: str, key: str = "broker address") -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``; a malformed one raises naming ``key``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{key} {address!r} must look like HOST:PORT with a port 1-65535, e.g. 127.0.0.1:1883")
    return host, int(port)


@dataclass(frozen=True)
class BrokerSettings:
    """Where and how to connect. ``protocol`` is ``"3.1.1"`` or ``"5"``.

    ``fallbacks``: further nodes of the same clustered broker (``HOST:PORT``, e.g. a NATS cluster's MQTT
    listeners, which share sessions and retained messages); each reconnect attempt takes the next address
    after ``host:port``, so a client outlives the node it was connected to (deploy/nats/README.md).
    """

    host: str = "127.0.0.1"
    port: int = 1883
    protocol: str = "3.1.1"
    keepalive_s: int = 30
    username: str | None = None
    password: str | None = None
    tls: TlsSettings | None = None
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 30.0
    fallbacks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.protocol not in ("3.1.1", "5"):
            raise ValueError(f'broker.protocol must be "3.1.1" or "5", got {self.protocol!r}')
        if not 0 < self.port < 65536:
            raise ValueError(f"broker.port must be 1-65535, got {self.port}")
        if not 1 <= self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError(
                "broker.reconnect_min_s must be >= 1 and <= broker.reconnect_max_s (whole seconds, paho's unit), "
                f"got {self.reconnect_min_s} and {self.reconnect_max_s}"
            )
        for i, address in enumerate(self.fallbacks):
            parse_address(address, f"broker.fallbacks[{i}]")

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Every node to try, in order: ``host:port`` first, then ``fallbacks``."""
        return [(self.host, self.port), *(parse_address(a) for a in self.fallbacks)]

    @property
    def address_list(self) -> str:
        """``HOST:PORT`` of every node, comma-separated (as ``from_address`` reads them)."""
        return ",".join([f"{self.host}:{self.port}", *self.fallbacks])

    @classmethod
    def from_address(cls, address: str, **kwargs: object) -> BrokerSettings:
        """Parse ``HOST:PORT`` (as given on the command line), or several separated by commas (a cluster's
        nodes: the first is ``host:port``, the others ``fallbacks``)."""
        first, *others = [part.strip() for part in address.split(",")]
        host, port = parse_address(first)
        for other in others:  # named as given, not as the config key they become
            parse_address(other)
        return cls(host=host, port=port, fallbacks=tuple(others), **kwargs)  # type: ignore[arg-type]
