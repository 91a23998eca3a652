"""Why an MQTT connection failed or was closed, in words, with the ``broker.*`` config key to fix.

Pure functions of the exception or reason and the settings of the node tried (``MqttClient.at``).
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.broker_settings import BrokerSettings


def describe_connect_error(exc: BaseException | None, settings: BrokerSettings) -> str:
    """Why a connection attempt failed, in words, with the likely fix (``broker.*`` config keys)."""
    where = f"{settings.host}:{settings.port}"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve broker host {settings.host!r} ({exc.strerror}): check broker.host"
    if isinstance(exc, ConnectionRefusedError):
        return f"nothing listens on {where}: is the broker running, and is broker.port right?"
    if isinstance(exc, TimeoutError):
        return f"no answer from {where}: wrong broker.host, or a firewall drops the connection"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the broker's certificate does not verify ({exc.verify_message}): {_verify_fix(exc, settings)}"
    tls_cut = settings.tls is not None and isinstance(exc, ConnectionResetError | BrokenPipeError)
    if isinstance(exc, ssl.SSLError) or tls_cut:
        why = exc.reason if isinstance(exc, ssl.SSLError) else "the broker hung up"
        return (
            f"TLS handshake with {where} failed ({why or exc}): is broker.port a TLS listener, and do "
            "broker.tls.certfile/keyfile belong to a CA the broker trusts?"
        )
    if isinstance(exc, OSError):
        return f"cannot connect to {where}: {exc.strerror or exc}"
    return f"cannot connect to {where}"


def _verify_fix(exc: ssl.SSLCertVerificationError, settings: BrokerSettings) -> str:
    """What to change for OpenSSL's verify code (X509_V_ERR_*): wrong name, out of date, or an unknown CA."""
    if exc.verify_code in (62, 64):  # HOSTNAME_MISMATCH, IP_ADDRESS_MISMATCH
        return f"the certificate is not for {settings.host!r}: set broker.host to a name it holds, or re-issue it"
    if exc.verify_code in (9, 10):  # NOT_YET_VALID, HAS_EXPIRED
        return "re-issue the broker's certificate (or check this host's clock)"
    return "check broker.tls.ca_certs (the CA that signed the broker's certificate)"


def describe_refusal(reason: object, settings: BrokerSettings) -> str:
    """A CONNACK refusal, with what to check."""
    text = str(reason)
    if "password" in text.lower() or "authori" in text.lower():
        fix = "check broker.username/password, or that the client certificate's CN is this node's id"
    elif "protocol version" in text.lower():
        fix = f'this broker does not speak MQTT {settings.protocol}: set broker.protocol = "3.1.1" (NATS 2.9 has no 5)'
    elif "identifier" in text.lower():
        fix = "another client may use this id, or the id is not allowed by the broker"
    else:
        fix = "see the broker's log"
    return f"broker {settings.host}:{settings.port} refused the connection ({text}): {fix}"


def effective_client_id(client_id: str, settings: BrokerSettings) -> str:
    """The client id the broker knows us by: with a TLS client certificate, SkyFed's mosquitto config
    (``use_username_as_clientid``) replaces the one we asked for with the certificate's name (CN)."""
    if settings.tls is None or not settings.tls.certfile:
        return client_id
    try:
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(Path(settings.tls.certfile).read_bytes())
        names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    except (OSError, ValueError):  # unreadable now: the id we asked for is the best guess left
        return client_id
    return str(names[0].value) if names else client_id


def taken_over_text(client_id: str, settings: BrokerSettings) -> str:
    """Why the broker closed a connection for another client with the same id, and what that id is."""
    return (
        f"{_other_client(client_id, settings)}: the broker closes one connection for the other (twice running "
        "right after accepting it, or MQTT 5's 'Session taken over'); run one client per id"
        + (" (per certificate)" if settings.tls is not None and settings.tls.certfile else "")
    )


def describe_disconnect(reason: object, client_id: str, settings: BrokerSettings) -> str:
    """A connection the broker closed, in words. paho says ``Unspecified error`` for a socket closed without a
    DISCONNECT, which is all mosquitto 2.0 sends a client it evicts for another one with the same id."""
    text = str(reason)
    if text == "Unspecified error":
        return (f"the broker closed the connection without a reason: {_other_client(client_id, settings)}, or "
                "the broker restarted or the network failed; if it repeats, stop the other client")  # fmt: skip
    if text in ("Server shutting down", "Administrative action"):
        return f"the broker closed the connection ({text}): it is stopping or was told to drop this client"
    if text == "Keep alive timeout":
        return f"no answer within {settings.keepalive_s} s (broker.keepalive_s): the network or the broker stalled"
    return f"connection lost ({text})"


def _other_client(client_id: str, settings: BrokerSettings) -> str:
    who = effective_client_id(client_id, settings)
    if settings.tls is not None and settings.tls.certfile:
        return f"another client connected with this client id {who!r} (the same certificate? {settings.tls.certfile})"
    return f"another client connected with this client id {who!r}"
