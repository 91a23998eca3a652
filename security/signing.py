"""Signed JSON documents (round tasks, agent status): public and readable, but authenticated by Ed25519.

``{"body": {...}, "signer": name, "sig": base64}`` where the signature covers a context string and
the canonical JSON of the body (sorted keys, no spaces, UTF-8), so any re-serialization verifies.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from cryptography.exceptions import InvalidSignature

from security.keys import Identity, Keyring, PublicIdentity

CONTEXT = b"skyfed/doc/v1"


class InvalidDocument(Exception):
    """A document that is malformed, from an unknown signer, or whose signature does not verify."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sign_document(body: dict[str, Any], identity: Identity) -> dict[str, Any]:
    signature = identity.signing_key.sign(CONTEXT + canonical(body))
    return {"body": body, "signer": identity.name, "sig": base64.b64encode(signature).decode()}


def signed_payload(body: dict[str, Any], identity: Identity) -> bytes:
    """``sign_document`` as the compact JSON bytes that go on the wire."""
    return json.dumps(sign_document(body, identity), separators=(",", ":")).encode()


def verify_document(document: Any, trusted: Keyring | PublicIdentity) -> dict[str, Any]:
    """The body of ``document`` if a trusted signer signed it; ``InvalidDocument`` otherwise."""
    if not isinstance(document, dict) or not isinstance(document.get("body"), dict):
        raise InvalidDocument("malformed")
    signer = document.get("signer")
    if not isinstance(signer, str):
        raise InvalidDocument("malformed")
    public = trusted.get(signer) if isinstance(trusted, Keyring) else trusted if trusted.name == signer else None
    if public is None:
        raise InvalidDocument("unknown-signer")
    try:
        message = CONTEXT + canonical(document["body"])
    except (ValueError, TypeError, RecursionError):  # not re-encodable (NaN, odd types, absurd nesting)
        raise InvalidDocument("malformed") from None
    try:
        signature = base64.b64decode(str(document.get("sig")), validate=True)
        public.verify_key.verify(signature, message)
    except (ValueError, InvalidSignature):
        raise InvalidDocument("bad-signature") from None
    return document["body"]


def _receipt_body(federation: str, run_id: str, round_number: int, model_version: int) -> dict[str, Any]:
    return {"receipt": "skyfed.round-held/1", "federation": federation, "run_id": run_id, "round": round_number,
            "model_version": model_version}  # fmt: skip


def round_receipt(identity: Identity, federation: str, run_id: str, round_number: int, model_version: int) -> str:
    """The server's signature that it issued ``round_number`` of ``run_id`` against ``model_version``: agents
    echo it in their status, so a server whose state went back in time can believe what they hold
    (``broker_server.rounds.catch_up``) without trusting their word."""
    return sign_document(_receipt_body(federation, run_id, round_number, model_version), identity)["sig"]


def receipt_valid(receipt: str, public: PublicIdentity, federation: str, run_id: str, round_number: int,
                  model_version: int) -> bool:  # fmt: skip
    body = _receipt_body(federation, run_id, round_number, model_version)
    try:
        verify_document({"body": body, "signer": public.name, "sig": receipt}, public)
    except InvalidDocument:
        return False
    return True
