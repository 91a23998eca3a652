"""``fp32``: the identity. The update is the named float32 change itself and the server reads it zero-copy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protocol.codecs.base import CodecError, CodecPlugin, NamedArrays, Shapes, expect_names


@dataclass(frozen=True)
class Float32(CodecPlugin):
    name = "fp32"
    spellings = ("fp32",)
    lossy = False

    def encode(self, change: Mapping[str, np.ndarray]) -> NamedArrays:
        return {name: np.asarray(a, np.float32) for name, a in change.items()}

    def decode(self, payload: Mapping[str, np.ndarray], shapes: Shapes) -> NamedArrays:
        expect_names(payload, (name for name, _ in shapes))
        for name, shape in shapes:
            if (got := payload[name]).dtype != np.float32 or got.shape != shape:
                raise CodecError(f"{name[:64]} is {got.dtype} {got.shape}, expected float32 {shape}")
        return {name: payload[name] for name, _ in shapes}
