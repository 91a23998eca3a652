"""Parse JSON that came from the network or a peer: one function, one error type, bounded work.

``json.loads`` alone lets several things escape that are not ``JSONDecodeError``: a ``RecursionError``
on deeply nested input, a ``ValueError`` on an integer of more than 4300 digits, ``NaN``/``Infinity``
literals and ``1e999`` (which becomes ``inf``). Every parser of untrusted bytes (messages, round tasks,
safetensors headers) goes through ``parse_untrusted_json`` so only ``UntrustedJsonError`` can escape.
"""

from __future__ import annotations

import json
import math
from typing import Any


class UntrustedJsonError(ValueError):
    """Bytes that are not acceptable JSON; the message says why (never echoes the input)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UntrustedJsonError(f"number {text[:32]!r} is out of range")
    return value


def _no_constants(name: str) -> Any:
    raise UntrustedJsonError(f"{name} is not allowed")


def parse_untrusted_json(payload: bytes | bytearray | memoryview | str, *, max_bytes: int) -> Any:
    """The decoded value, or ``UntrustedJsonError``; refuses input longer than ``max_bytes`` unread."""
    if len(payload) > max_bytes:
        raise UntrustedJsonError(f"{len(payload)} bytes exceed the limit of {max_bytes}")
    try:
        text = payload if isinstance(payload, str) else bytes(payload).decode("utf-8")
        return json.loads(text, parse_float=_finite_float, parse_constant=_no_constants)
    except UntrustedJsonError:
        raise
    except RecursionError:
        raise UntrustedJsonError("nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError, as is the digit limit
        raise UntrustedJsonError(f"not JSON: {str(exc)[:120]}") from None
