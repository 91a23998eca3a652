"""Build typed dataclasses from untrusted JSON/TOML tables, with errors that name the key.

Shared by the message schemas (``protocol.messages``) and the daemons' config files, so both check
types the same way: ints are not bools, floats are finite, nested dataclasses come from tables, and
unknown keys are refused (config) or ignored (messages, for forward compatibility).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class SchemaError(ValueError):
    """A value does not fit the expected type; the message names the key."""


_AS_IS = (str, int)  # items of these exact types convert to themselves (a bool is not an int here)


def finite(value: int | float) -> bool:
    """Whether a JSON number is a finite float: an integer past float's range (JSON allows 1 followed by 400
    zeros) is not, where ``math.isfinite`` raises ``OverflowError`` on it."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _convert(where: str, value: Any, hint: Any, strict: bool) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return None
        if len(options) == 1:  # Optional[X]: X's own, more precise, error
            return _convert(where, value, options[0], strict)
        for option in options:
            try:
                return _convert(where, value, option, strict)
            except SchemaError:
                continue
    elif hint is type(None):
        if value is None:
            return None
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and finite(value):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint in (str, bool):
        if isinstance(value, hint):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):  # a tuple: a message's own ``to_dict``, before JSON
            item = typing.get_args(hint)[0]
            if item in _AS_IS and all(type(v) is item for v in value):  # a round task's lists name every agent
                items = list(value)
            else:
                items = [_convert(f"{where}[{i}]", v, item, strict) for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
    elif origin is dict or hint is dict:
        if isinstance(value, dict):
            return value
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return build(hint, value, where=where, strict=strict)
    raise SchemaError(f"{where} has the wrong type: {value!r} (expected {_type_name(hint)})")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A dataclass's resolved type hints and fields, worked out once: ``get_type_hints`` evaluates every
    annotation string each call, and a server parses a signed status per agent every few seconds."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


def build(cls: type[T], data: dict[str, Any], *, where: str, strict: bool) -> T:
    """``cls(**data)`` after type checks; ``strict`` refuses unknown keys (configs), else ignores them."""
    hints, known = _schema(cls)
    if strict:
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
                raise SchemaError(f"{where}.{key} is not a known key{hint}")
    values = {name: _convert(f"{where}.{name}", data[name], hints[name], strict) for name in known if name in data}
    missing = [
        name
        for name, f in known.items()
        if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise SchemaError(f"{where} is missing required key(s): {', '.join(missing)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        message = str(exc)  # a message that already names the key (``where.key …``) is not prefixed again
        raise SchemaError(message if message.startswith(f"{where}.") else f"{where}: {message}") from None
