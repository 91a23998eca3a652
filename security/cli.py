"""``skyfed keys new NAME --dir DIR`` and ``skyfed keys enroll AGENT.pub --enrolled DIR``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from security.keys import Identity, KeyFileError, PublicIdentity, enroll


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
    print(f"wrote {path} (mode 0600) and {public_path}; fingerprint {identity.public.fingerprint()}")
    return 0


def enroll_key(args: argparse.Namespace) -> int:
    try:
        public = PublicIdentity.load(Path(args.pub))
    except KeyFileError as exc:
        print(f"skyfed keys: {exc}", file=sys.stderr)
        return 2
    path = enroll(Path(args.enrolled), public)
    print(f"enrolled {public.name} (fingerprint {public.fingerprint()}) as {path}; restart the server to load it")
    return 0


def add_keys_commands(commands: argparse._SubParsersAction) -> None:
    keys = commands.add_parser("keys", help="create and enrol node keys").add_subparsers(dest="action", required=True)
    new = keys.add_parser("new", help="create NAME.key (0600) and NAME.pub in --dir")
    new.add_argument("name", help="agent id or 'server'")
    new.add_argument("--dir", required=True)
    new.set_defaults(handler=new_key)
    add = keys.add_parser("enroll", help="trust an agent: copy its .pub into the server's enrolled folder")
    add.add_argument("pub", help="path to the agent's NAME.pub")
    add.add_argument("--enrolled", required=True, help="the server's keys.enrolled folder")
    add.set_defaults(handler=enroll_key)
