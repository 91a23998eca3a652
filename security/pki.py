"""A small X.509 PKI for broker TLS: a federation CA, the broker's server certificate, client certificates.

The client certificate's CN is the node's SkyFed name (agent id or ``server``), which mosquitto can
use as the MQTT username (``use_identity_as_username``) so an ACL confines each agent to its own
topics. Command line: ``skyfed certs ca|broker|client`` for one certificate at a time, ``skyfed provision``
(``security/provision.py``) for a whole federation, whose revocations go into the CA's CRL (``write_crl``).
Private keys are ECDSA P-256, written 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.files import atomic_write
from security.keys import check_name

VALIDITY = dt.timedelta(days=825)


@dataclass(frozen=True)
class Issued:
    """Paths of a certificate and its private key (PEM)."""

    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "SkyFed"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.crt.key"
    atomic_write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    atomic_write(
        key_path,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        mode=0o600,
    )
    return Issued(cert_path, key_path)


def create_ca(directory: Path, federation: str) -> Issued:
    """A self-signed CA for one federation (``ca.crt``, ``ca.crt.key``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"SkyFed CA {federation}"))
        .issuer_name(_name(f"SkyFed CA {federation}"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return _write(directory, "ca", cert, key)


def _load_ca(ca: Issued) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey), "SkyFed CAs are ECDSA P-256"
    return x509.load_pem_x509_certificate(ca.cert.read_bytes()), key


def issue(
    ca: Issued, directory: Path, common_name: str, *, hosts: tuple[str, ...] = (), stem: str | None = None
) -> Issued:
    """A certificate signed by ``ca``: a broker certificate when ``hosts`` are given, else a client one.
    Written as ``<stem>.crt`` (default: the common name) and its key."""
    ca_cert, ca_key = _load_ca(ca)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name if hosts else check_name(common_name)))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return _write(directory, stem or common_name, cert, key)


def write_pkcs12(issued: Issued, ca_cert: Path, path: Path, password: bytes) -> None:
    """``issued`` with its key and the CA as one password-protected PKCS#12 file: what a browser imports."""
    from cryptography.hazmat.primitives.serialization import pkcs12

    key = serialization.load_pem_private_key(issued.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    cert = x509.load_pem_x509_certificate(issued.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    bundle = pkcs12.serialize_key_and_certificates(
        cert.subject.rfc4514_string().encode(), key, cert, [ca], serialization.BestAvailableEncryption(password)
    )
    atomic_write(path, bundle)


def serial_of(cert_path: Path) -> int:
    return x509.load_pem_x509_certificate(cert_path.read_bytes()).serial_number


def write_crl(ca: Issued, path: Path, revoked: list[tuple[int, float]]) -> None:
    """The CA's certificate revocation list (PEM), valid as long as the CA: the broker refuses a TLS
    handshake with any revoked ``(serial, unix time of revocation)`` once it has (re)loaded the file. An
    empty list is a valid CRL too, so the broker's config can name the file from the start."""
    ca_cert, ca_key = _load_ca(ca)
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - dt.timedelta(minutes=5))
        .next_update(ca_cert.not_valid_after_utc)
    )
    for serial, at in revoked:
        when = dt.datetime.fromtimestamp(at, dt.timezone.utc)
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    atomic_write(path, crl.public_bytes(serialization.Encoding.PEM))
