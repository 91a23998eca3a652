"""``skyfed keys new|enroll`` (node keys) and ``skyfed certs ca|broker|client`` (broker TLS)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from security.keys import Identity, KeyFileError, PublicIdentity, enroll, revoke


def ownership_hint(*paths: Path) -> str:
    """Files made by root are unreadable to the service users that need them: say so, with the command."""
    if os.geteuid() != 0:
        return ""
    files = " ".join(str(p) for p in paths)
    return (
        f"\nnote: written as root, mode 0600. The daemon that uses them must own them, e.g. "
        f"chown skyfed:skyfed {files} for the skyfed-*.service user (or chown mosquitto: for the broker's "
        "certificate key)"
    )


def new_key(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    target = directory / f"{args.name}.key"
    if target.exists():
        print(f"skyfed keys: {target} exists; refusing to overwrite a private key", file=sys.stderr)
        return 2
    try:
        identity = Identity.generate(args.name)
    except ValueError as exc:
        print(f"skyfed keys: {exc}", file=sys.stderr)
        return 2
    path = identity.save(directory)
    public_path = directory / f"{args.name}.pub"
    fingerprint = identity.public.fingerprint()
    print(f"wrote {path} (mode 0600) and {public_path}; fingerprint {fingerprint}{ownership_hint(path)}")
    return 0


def enroll_key(args: argparse.Namespace) -> int:
    """Enrol every named .pub; any unreadable one is refused before anything is enrolled."""
    try:
        publics = [PublicIdentity.load(Path(pub)) for pub in args.pub]
    except KeyFileError as exc:
        print(f"skyfed keys: {exc}", file=sys.stderr)
        return 2
    for public in publics:
        enroll_one(Path(args.enrolled), public)
    return 0


def enroll_one(enrolled: Path, public: PublicIdentity) -> None:
    existing = enrolled / f"{public.name}.pub"
    if existing.exists():
        try:
            old = PublicIdentity.load(existing).fingerprint()
        except KeyFileError:
            old = "unreadable"
        if old != public.fingerprint():
            print(
                f"skyfed keys: warning: replacing {public.name}'s enrolled key (fingerprint {old}) with "
                f"{public.fingerprint()}: the old key will no longer be trusted",
                file=sys.stderr,
            )
    path = enroll(enrolled, public)
    fingerprint = public.fingerprint()
    print(f"enrolled {public.name} (fingerprint {fingerprint}) as {path}; a running server trusts it within a second")


def revoke_key(args: argparse.Namespace) -> int:
    try:
        path = revoke(Path(args.enrolled), args.name)
    except (KeyFileError, ValueError) as exc:
        print(f"skyfed keys: {exc}", file=sys.stderr)
        return 2
    print(
        f"revoked {args.name}: its key moved to {path}; a running server refuses it within a second and rotates "
        "the group key"
    )
    return 0


def certs(args: argparse.Namespace) -> int:
    from security.pki import Issued, create_ca, issue

    directory = Path(args.dir)
    ca = Issued(directory / "ca.crt", directory / "ca.crt.key")
    if args.action == "ca":
        if ca.cert.exists():
            print(f"skyfed certs: {ca.cert} exists; refusing to replace the federation's CA", file=sys.stderr)
            return 2
        made = create_ca(directory, args.federation)
        print(f"wrote {made.cert} and {made.key} (mode 0600); keep the CA key off the broker and the devices")
        return 0
    if not ca.cert.exists():
        print(
            f"skyfed certs: no CA in {directory}: run `skyfed certs ca --dir {directory} --federation NAME` first",
            file=sys.stderr,
        )
        return 2
    try:
        name = args.name if args.action == "client" else args.hosts[0]
        made = issue(ca, directory, name, hosts=tuple(args.hosts) if args.action == "broker" else ())
    except ValueError as exc:
        print(f"skyfed certs: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {made.cert} and {made.key} (mode 0600){ownership_hint(made.key)}")
    return 0


def add_certs_commands(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "certs",
        help="X.509 certificates for mutual TLS with the broker",
        description="A federation CA (ca.crt), the broker's certificate, and one client certificate per node "
        "(CN = node id, which mosquitto's use_identity_as_username makes the MQTT username for the ACL in "
        "deploy/mosquitto/skyfed.acl). Keys are written 0600.",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    ca = actions.add_parser("ca", help="create DIR/ca.crt and its key")
    ca.add_argument("--federation", required=True)
    broker = actions.add_parser("broker", help="the broker's certificate, for the names clients connect to")
    broker.add_argument("--host", dest="hosts", action="append", required=True, help="DNS name or IP (repeatable)")
    client = actions.add_parser("client", help="a node's client certificate (CN = NAME)")
    client.add_argument("name", help="agent id or 'server'")
    for sub in (ca, broker, client):
        sub.add_argument("--dir", required=True, help="the folder holding ca.crt (and where files are written)")
        sub.set_defaults(handler=certs)


def add_keys_commands(commands: argparse._SubParsersAction) -> None:
    keys = commands.add_parser("keys", help="create and enrol node keys").add_subparsers(dest="action", required=True)
    new = keys.add_parser("new", help="create NAME.key (0600) and NAME.pub in --dir")
    new.add_argument("name", help="agent id or 'server'")
    new.add_argument("--dir", required=True)
    new.set_defaults(handler=new_key)
    add = keys.add_parser("enroll", help="trust an agent: copy its .pub into the server's enrolled folder")
    add.add_argument("pub", nargs="+", help="path to the agent's NAME.pub (several at once: each is enrolled)")
    add.add_argument("--enrolled", required=True, help="the server's keys.enrolled folder")
    add.set_defaults(handler=enroll_key)
    revoke_parser = keys.add_parser("revoke", help="stop trusting an agent: move its .pub to enrolled/revoked/")
    revoke_parser.add_argument("name", help="the agent id")
    revoke_parser.add_argument("--enrolled", required=True, help="the server's keys.enrolled folder")
    revoke_parser.set_defaults(handler=revoke_key)
