"""Update codecs ("thin links"): how an agent's float32 change shrinks before it is sealed, and how the
server turns it back into float32 before any check (finite, norm, shapes) runs.

The server's ``server.codec`` names one; the signed round task carries it and each update's sealed
``UpdateMeta.codec`` repeats it. Each codec is a plug-in (``base.CodecPlugin``), one module each,
registered below with one line (docs/architecture.md, "Plug-ins"); the choices in CLI help and config
errors come from the registry. ``fp32`` is the identity; the others put a few flat arrays under fixed names
starting with ``@`` (no model tensor name is ever used, so none can collide), the running statistics
dense and exact (``base``). Pure numpy: this package must never import torch or ``models``
(``protocol`` is the wire contract both daemons import).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from common.registry import Registry, UnknownPlugin
from protocol.codecs.base import (
    DENSE,
    INDICES,
    RUNNING_STATISTICS,
    SCALES,
    VALUES,
    CodecError,
    CodecPlugin,
    NamedArrays,
    Shapes,
    TensorShape,
)
from protocol.codecs.feedback import Compressed, ErrorFeedback, compress
from protocol.codecs.topk import top_count

CODECS: Registry[type[CodecPlugin]] = Registry("codec", "server.codec")
CODECS.add("fp32", "protocol.codecs.fp32:Float32")
CODECS.add("fp16", "protocol.codecs.fp16:Float16")
CODECS.add("int8", "protocol.codecs.int8:Int8")
CODECS.add("topk", "protocol.codecs.topk:TopK")
CODECS.add("qsgd4", "protocol.codecs.qsgd:QSGD4")


def spellings() -> tuple[str, ...]:
    """Every way ``server.codec`` may be written, argument placeholders included (``topk:FRACTION``)."""
    return tuple(spelling for _, plugin in CODECS.items() for spelling in plugin.spellings)


def choices() -> str:
    """The choices as a sentence's list, with what each argument may be: for help texts and errors."""
    names, hints = spellings(), [plugin.hint for _, plugin in CODECS.items() if plugin.hint]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f"{listed} ({'; '.join(hints)})" if hints else listed


def __getattr__(name: str) -> str:
    if name == "CHOICES":  # computed on use, so that a plug-in added later (a test's) is listed
        return choices()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Codec:
    """``server.codec``'s value: a registered plug-in with its argument. ``Codec("topk", fraction=0.01)``
    builds one by name and settings; ``Codec.parse("topk:0.01")`` reads the text configs and messages carry."""

    __slots__ = ("plugin",)

    def __init__(self, kind: str | CodecPlugin = "fp32", **settings: Any) -> None:
        self.plugin = kind if isinstance(kind, CodecPlugin) else CODECS.get(kind)(**settings)

    @classmethod
    def parse(cls, text: str) -> Codec:
        kind, colon, arg = text.partition(":")
        try:
            return cls(CODECS.get(kind).parse(arg if colon else None))
        except (UnknownPlugin, ValueError):
            raise CodecError(f"unknown codec {text[:40]!r}; choose {choices()}") from None

    @property
    def kind(self) -> str:
        return self.plugin.name

    @property
    def feedback(self) -> bool:
        """Whether ``compress`` carries the unsent remainder into the next round (the plug-in declares it)."""
        return self.plugin.error_feedback

    def __str__(self) -> str:
        return str(self.plugin)

    def __repr__(self) -> str:
        return f"Codec({self.plugin!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.plugin == other.plugin

    def __hash__(self) -> int:
        return hash(self.plugin)


FP32 = Codec()


def encode(change: Mapping[str, np.ndarray], codec: Codec) -> NamedArrays:
    """The arrays to serialize for ``change`` (float deltas as ``models.weights.delta`` makes them)."""
    return codec.plugin.encode(change)


def decode(payload: Mapping[str, np.ndarray], codec: Codec, spec: Sequence[TensorShape]) -> NamedArrays:
    """Float32 arrays with exactly ``spec``'s names and shapes, in its order; ``CodecError`` if ``payload``
    (untrusted) is not a ``codec`` encoding of such a change."""
    return codec.plugin.decode(payload, tuple((s.name, tuple(s.shape)) for s in spec))


__all__ = [
    "CODECS", "DENSE", "FP32", "INDICES", "RUNNING_STATISTICS", "SCALES", "VALUES", "Codec", "CodecError",
    "CodecPlugin", "Compressed", "ErrorFeedback", "NamedArrays", "Shapes", "choices", "compress", "decode",
    "encode", "spellings", "top_count",
]  # fmt: skip
