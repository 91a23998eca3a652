"""Reading the daemons' TOML config files: one error type that names the file, the key and the fix.

Both ``agent.toml`` and ``server.toml`` have a ``[broker]`` table (``BrokerSettings``) plus their own
tables; each table becomes a typed dataclass through ``protocol.typed.build`` with unknown keys refused,
so a typo fails at start instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from common import toml
from common.files import atomic_write
from protocol.broker_settings import BrokerSettings, TlsSettings
from protocol.typed import SchemaError, build

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file cannot be used; the message names the file, the key and what to do."""


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return toml.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (pass --config PATH)") from None
    except OSError as exc:  # a folder, unreadable, ...
        raise ConfigError(f"{path}: cannot read this config file ({exc.strerror or exc}): pass --config FILE") from None
    except toml.TOMLDecodeError as exc:
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


def check_tables(path: Path, data: dict[str, Any], known: dict[str, type | None]) -> None:
    """Every table is one ``known`` names (with its dataclass, None for a free-form one), and a key given in
    the wrong table but known to another one is named with the table it belongs in."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{path}: unknown table [{unknown[0]}]; known tables: {', '.join(sorted(known))}")
    keys = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in known.items() if cls is not None}
    for name, raw in data.items():
        if name not in keys or not isinstance(raw, dict):
            continue
        for key in raw:
            home = [other for other, fields in keys.items() if other != name and key in fields]
            if key not in keys[name] and home:
                raise ConfigError(f"{path}: {name}.{key} belongs in [{home[0]}]: move `{key} = …` there")


def refuse_unused(data: dict[str, Any], unused: dict[str, str], context: str) -> None:
    """Refuse a table (``"metrics"``) or key (``"training.onnx"``) of ``unused`` that ``data`` gives: a role that never
    reads it would ignore it without a word. ``unused`` maps each to why; ``context`` names the role."""
    for key, why in unused.items():
        name, _, inner = key.partition(".")
        given = data.get(name)
        if given is not None and (not inner or (isinstance(given, dict) and inner in given)):
            raise ValueError(f"{key if inner else f'[{key}]'} is not used {context}: {why}; remove it")


def broker_settings(path: Path, data: dict[str, Any], name: str = "broker") -> BrokerSettings:
    """``[broker]`` (or the table ``name``, e.g. ``upstream.broker`` given as a top-level key of ``data``) with
    its optional ``.tls`` table, whose files are resolved relative to the config file (as every other path is)
    and must exist: a provisioned node folder works wherever it is installed."""
    settings = table(path, data, name, BrokerSettings)
    tls = settings.tls
    if tls is None:
        return settings

    def resolved(key: str, value: str | None, what: str) -> str | None:
        return None if value is None else str(existing_path(path, f"{name}.tls.{key}", value, what))

    return replace(
        settings,
        tls=TlsSettings(
            ca_certs=resolved("ca_certs", tls.ca_certs, "CA certificate") or "",
            certfile=resolved("certfile", tls.certfile, "client certificate"),
            keyfile=resolved("keyfile", tls.keyfile, "client certificate key"),
        ),
    )


def existing_path(path: Path, key: str, value: str, what: str, fix: str = "") -> Path:
    """Resolve ``value`` relative to the config file and check that it exists; ``fix`` says where such a file
    comes from."""
    resolved = (path.parent / value).resolve() if not Path(value).is_absolute() else Path(value)
    if not resolved.exists():
        raise ConfigError(f"{path}: {key} = {value!r}: {what} not found at {resolved}{f' ({fix})' if fix else ''}")
    return resolved


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def write_toml(path: Path, tables: dict[str, dict[str, object]], *, footer: str = "") -> None:
    """Write tables of scalars and lists of scalars; a dict value becomes a sub-table (``[broker.tls]``).
    ``footer``: comment lines after the last table (a template for keys only the operator can choose)."""
    lines: list[str] = []

    def emit(name: str, values: dict[str, object]) -> None:
        if not values:
            return
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {_toml_value(v)}" for key, v in values.items() if not isinstance(v, dict))
        lines.append("")
        for key, v in values.items():
            if isinstance(v, dict):
                emit(f"{name}.{key}", v)

    for name, values in tables.items():
        emit(name, values)
    atomic_write(path, ("\n".join(lines) + footer).encode())
