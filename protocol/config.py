"""Reading the daemons' TOML config files: one error type that names the file, the key and the fix.

Both ``agent.toml`` and ``server.toml`` have a ``[broker]`` table (``BrokerSettings``) plus their own
tables; each table becomes a typed dataclass through ``protocol.typed.build`` with unknown keys refused,
so a typo fails at start instead of being silently ignored.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from protocol.mqtt import BrokerSettings
from protocol.typed import SchemaError, build

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file cannot be used; the message names the file, the key and what to do."""


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (pass --config PATH)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def table(path: Path, data: dict[str, Any], name: str, cls: type[T], *, required: bool = True) -> T:
    """Build ``cls`` from the TOML table ``[name]``; errors read ``path: [name] key ...``."""
    raw = data.get(name)
    if raw is None:
        if required:
            raise ConfigError(f"{path}: missing table [{name}]; see deploy/examples/ for a complete file")
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {name} must be a table ([{name}])")
    try:
        return build(cls, raw, where=name, strict=True)
    except SchemaError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def check_tables(path: Path, data: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown table [{unknown[0]}]; known tables: {', '.join(sorted(known))}")


def broker_settings(path: Path, data: dict[str, Any]) -> BrokerSettings:
    """``[broker]`` with its optional ``[broker.tls]`` table."""
    return table(path, data, "broker", BrokerSettings)


def existing_path(path: Path, key: str, value: str, what: str) -> Path:
    """Resolve ``value`` relative to the config file and check that it exists."""
    resolved = (path.parent / value).resolve() if not Path(value).is_absolute() else Path(value)
    if not resolved.exists():
        raise ConfigError(f"{path}: {key} = {value!r}: {what} not found at {resolved}")
    return resolved
