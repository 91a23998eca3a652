"""One idiom for every kind of plug-in (strategies, client recipes, codecs, datasets; docs/architecture.md,
"Plug-ins"): a registry maps a name to ``"package.module:Attribute"``, one ``add`` line per plug-in, and
imports the plug-in on first use. What a plug-in can do is declared on the plug-in itself (class
attributes); every check elsewhere asks the plug-in (``where``), never a list of names, and CLI choices,
config errors and docs tables come from ``names``.

Imported lazily so that a daemon can list or check names without importing what a plug-in needs to run
(PyTorch for a training recipe, say): the edge agent's daemon stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownPlugin(ValueError):
    """A name no plug-in of this kind is registered under; the message names the config key and the choices."""


class Registry(Generic[T]):
    """The plug-ins of one kind, in registration order. ``key`` is what a user sets to choose one (for
    errors: ``strategy.name``, ``server.codec``)."""

    def __init__(self, kind: str, key: str) -> None:
        self.kind, self.key = kind, key
        self._where: dict[str, str] = {}
        self._loaded: dict[str, T] = {}

    def add(self, name: str, where: str | T) -> None:
        """Register ``name`` as the attribute ``where`` = ``"package.module:Attribute"`` (imported on first use),
        or as a plug-in already imported (a test's, an operator's own)."""
        if name in self._where:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        if not isinstance(where, str):
            self._where[name], self._loaded[name] = f"{type(where).__module__}:{name}", where
            return
        module, _, attribute = where.partition(":")
        if not module or not attribute:
            raise ValueError(f"{self.kind} {name!r}: where must be 'package.module:Attribute', got {where!r}")
        self._where[name] = where

    def remove(self, name: str) -> None:
        """Take ``name`` out again (a test's plug-in)."""
        self._where.pop(name)
        self._loaded.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def choices(self) -> str:
        """The names as a sentence's list: ``a, b or c``."""
        names = self.names()
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"

    def get(self, name: str) -> T:
        """The plug-in registered as ``name``; ``UnknownPlugin`` names the key and the choices otherwise."""
        if name not in self._where:
            raise UnknownPlugin(f"{self.key} {name!r} is unknown; choose one of {', '.join(sorted(self.names()))}")
        if name not in self._loaded:
            module, _, attribute = self._where[name].partition(":")
            plugin = getattr(importlib.import_module(module), attribute)
            declared = getattr(plugin, "name", name)
            if declared != name:
                raise ValueError(f"{self.kind} registered as {name!r} declares name {declared!r}")
            self._loaded[name] = plugin
        return self._loaded[name]

    def items(self) -> Iterator[tuple[str, T]]:
        """Every plug-in, loaded, in registration order."""
        for name in self._where:
            yield name, self.get(name)

    def where(self, test: Callable[[T], bool]) -> tuple[str, ...]:
        """The names of the plug-ins that ``test`` accepts (a question about their declared capabilities)."""
        return tuple(name for name, plugin in self.items() if test(plugin))
