"""Node identities (Ed25519 for signatures, X25519 for key agreement), enrolment and group keys.

Key files: ``<name>.key`` holds both private keys (JSON, base64 raw bytes), created with mode 0600
without any moment of wider access, and refused at load if group- or world-readable;
``<name>.pub`` holds both public keys and is safe to copy around. Enrolment is nothing more than a
folder of ``.pub`` files the receiving node trusts (the server's ``enrolled/``; an agent's copy of
``server.pub``). Revocation removes the file and rotates the federation's group key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from common.files import atomic_write

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RAW = {"encoding": serialization.Encoding.Raw, "format": serialization.PublicFormat.Raw}


class KeyFileError(ValueError):
    """A key file is missing, malformed or too widely readable; the message says how to fix it."""


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise ValueError(
            f"identity name {name!r} must be 1-64 characters from A-Z a-z 0-9 _ . - (it becomes a topic level)"
        )
    return name


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(path: Path, text: object, size: int) -> bytes:
    try:
        raw = base64.b64decode(str(text), validate=True)
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise KeyFileError(f"{path}: malformed key material (expected {size} bytes of base64)")
    return raw


def _parse_key_file(path: Path, text: str, what: str) -> tuple[str, bytes, bytes]:
    """``(name, ed25519 raw, x25519 raw)`` from a SkyFed key file's JSON of kind ``what``.

    Private and public files have the same fields, so each says its ``kind``; files written before that
    field existed are told apart by their suffix (``.key`` is private)."""
    try:
        data = json.loads(text)
        name = check_name(data["name"])
        kind = data.get("kind") or ("private" if path.suffix == ".key" else what)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise KeyFileError(f"{path}: not a SkyFed {what} key file ({exc})") from None
    if kind != what and kind == "private":
        public = (
            f"the public key next to it ({path.with_suffix('.pub').name})"
            if path.suffix != ".pub"
            else (f"{name}.pub, which `skyfed keys new` wrote beside it")
        )
        raise KeyFileError(f"{path} is a PRIVATE key: use {public}; a private key never leaves its node")
    if kind != what:
        raise KeyFileError(f"{path} is a {kind} key; this needs the node's private key ({name}.key)")
    return name, _unb64(path, data.get("ed25519"), 32), _unb64(path, data.get("x25519"), 32)


def _ownership(path: Path) -> str:
    """Who owns ``path`` and who is asking, with the command that fixes it (root-made keys, say)."""
    import pwd

    def user(uid: int) -> str:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return str(uid)

    try:
        owner = user(path.stat().st_uid)
    except OSError:
        return "permission denied on its folder"
    me = user(os.geteuid())
    return f"it belongs to {owner} and this process runs as {me}: run  chown {me}: {path}"


def _raw_private(key: Ed25519PrivateKey | X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


@dataclass(frozen=True)
class PublicIdentity:
    name: str
    verify_key: Ed25519PublicKey
    exchange_key: X25519PublicKey

    def raw(self) -> tuple[bytes, bytes]:
        return self.verify_key.public_bytes(**RAW), self.exchange_key.public_bytes(**RAW)

    def fingerprint(self) -> str:
        """Short hex digest of both public keys, for logs and for comparing by eye."""
        return hashlib.sha256(b"".join(self.raw())).hexdigest()[:16]

    def to_json(self) -> str:
        ed, x = self.raw()
        body = {"name": self.name, "kind": "public", "ed25519": _b64(ed), "x25519": _b64(x)}
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, path: Path = Path("<memory>")) -> PublicIdentity:
        name, ed, x = _parse_key_file(path, text, "public")
        return cls(name, Ed25519PublicKey.from_public_bytes(ed), X25519PublicKey.from_public_bytes(x))

    @classmethod
    def load(cls, path: Path) -> PublicIdentity:
        try:
            return cls.from_json(path.read_text(), path)
        except OSError as exc:
            raise KeyFileError(f"{path}: cannot read public key ({exc.strerror})") from None

    def save(self, path: Path) -> None:
        atomic_write(path, self.to_json().encode())


@dataclass(frozen=True)
class Identity:
    """A node's private keys and name."""

    name: str
    signing_key: Ed25519PrivateKey
    exchange_key: X25519PrivateKey

    @classmethod
    def generate(cls, name: str) -> Identity:
        return cls(check_name(name), Ed25519PrivateKey.generate(), X25519PrivateKey.generate())

    @property
    def public(self) -> PublicIdentity:
        return PublicIdentity(self.name, self.signing_key.public_key(), self.exchange_key.public_key())

    def save(self, directory: Path) -> Path:
        """Write ``<name>.key`` (0600) and ``<name>.pub`` into ``directory``; return the key path."""
        body = {
            "name": self.name,
            "kind": "private",
            "ed25519": _b64(_raw_private(self.signing_key)),
            "x25519": _b64(_raw_private(self.exchange_key)),
        }
        path = directory / f"{self.name}.key"
        atomic_write(path, json.dumps(body).encode(), mode=0o600)
        self.public.save(directory / f"{self.name}.pub")
        return path

    @classmethod
    def load(cls, path: Path) -> Identity:
        try:
            mode = path.stat().st_mode
            text = path.read_text()
        except PermissionError:
            raise KeyFileError(f"{path}: cannot read private key: {_ownership(path)}") from None
        except OSError as exc:
            raise KeyFileError(f"{path}: cannot read private key ({exc.strerror})") from None
        name, ed, x = _parse_key_file(path, text, "private")  # first: a public key given here says so
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(
                f"{path}: private key is readable by others (mode {oct(mode & 0o777)}); run: chmod 600 {path}"
            )
        return cls(name, Ed25519PrivateKey.from_private_bytes(ed), X25519PrivateKey.from_private_bytes(x))


class Keyring:
    """The public identities a node trusts, by name."""

    def __init__(self, identities: list[PublicIdentity] | None = None) -> None:
        self._by_name: dict[str, PublicIdentity] = {}
        for identity in identities or []:
            self.add(identity)

    @classmethod
    def load_dir(cls, directory: Path) -> Keyring:
        return cls([PublicIdentity.load(p) for p in sorted(directory.glob("*.pub"))])

    def add(self, identity: PublicIdentity) -> None:
        self._by_name[identity.name] = identity

    def get(self, name: str) -> PublicIdentity | None:
        return self._by_name.get(name)

    def remove(self, name: str) -> None:
        self._by_name.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)


REVOKED = "revoked"  # subfolder of the enrolment folder: keys no longer trusted, kept to say why


def enroll(directory: Path, identity: PublicIdentity) -> Path:
    """Trust ``identity``: write ``<name>.pub`` into the enrolment folder (and un-revoke it)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{identity.name}.pub"
    identity.save(path)
    (directory / REVOKED / path.name).unlink(missing_ok=True)
    return path


def revoke(directory: Path, name: str) -> Path:
    """Stop trusting ``name``: move its ``.pub`` into ``<enrolled>/revoked/`` (the server then says why
    it ignores the agent instead of treating it as a stranger)."""
    source = directory / f"{check_name(name)}.pub"
    if not source.exists():
        raise KeyFileError(f"{source}: no such enrolled agent")
    (directory / REVOKED).mkdir(exist_ok=True)
    target = directory / REVOKED / source.name
    source.rename(target)
    return target


def revoked_names(directory: Path) -> set[str]:
    return {p.stem for p in (directory / REVOKED).glob("*.pub")}


Snapshot = dict[str, tuple[int, int]]  # name -> (size, mtime_ns) of its .pub


def snapshot(directory: Path) -> Snapshot:
    """An enrolment folder's ``.pub`` files by name, to notice enrolments and revocations without a restart."""
    files: Snapshot = {}
    for path in directory.glob("*.pub"):
        try:
            stat = path.stat()
        except OSError:  # removed between listing and stat
            continue
        files[path.stem] = (stat.st_size, stat.st_mtime_ns)
    return files


@dataclass(frozen=True)
class GroupKey:
    """The federation's symmetric key for the broadcast global model; ``key_id`` names its generation."""

    key_id: str
    key: bytes

    @classmethod
    def generate(cls) -> GroupKey:
        return cls(secrets.token_hex(4), secrets.token_bytes(32))

    def to_bytes(self) -> bytes:
        return self.key_id.encode() + self.key

    @classmethod
    def from_bytes(cls, data: bytes) -> GroupKey:
        if len(data) != 40 or not re.fullmatch(rb"[0-9a-f]{8}", data[:8]):
            raise KeyFileError("group key must be 8 hex characters of id followed by 32 key bytes")
        return cls(data[:8].decode(), bytes(data[8:]))
