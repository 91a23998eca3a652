"""``fp16``: ``@values`` float16, clipped to float16's range so that a value never becomes infinite."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protocol.codecs.base import VALUES, CodecPlugin, NamedArrays, Shapes, field, size

FP16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class Float16(CodecPlugin):
    name = "fp16"
    spellings = ("fp16",)
    fields = (VALUES,)

    def encode_values(self, values: np.ndarray, coded: Shapes) -> NamedArrays:
        return {VALUES: np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16)}

    def decode_values(self, payload: Mapping[str, np.ndarray], coded: Shapes) -> np.ndarray:
        return field(payload, VALUES, np.float16, size(coded)).astype(np.float32)
