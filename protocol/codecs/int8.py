"""``int8`` / ``int8:channel``: ``@values`` int8 and ``@scales`` float32, one per tensor, or one per output
channel (axis 0) of tensors with ndim >= 2; a value is ``q * scale``, within ``scale / 2``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protocol.codecs.base import SCALES, VALUES, CodecPlugin, NamedArrays, Shapes, field, scales, size, starts


@dataclass(frozen=True)
class Int8(CodecPlugin):
    name = "int8"
    spellings = ("int8", "int8:channel")
    fields = (VALUES, SCALES)
    per_channel: bool = False  # one scale per output channel

    @classmethod
    def parse(cls, arg: str | None) -> Int8:
        if arg not in (None, "channel"):
            raise ValueError("int8 takes no argument but 'channel'")
        return cls(per_channel=arg == "channel")

    def __str__(self) -> str:
        return "int8:channel" if self.per_channel else "int8"

    def row_lengths(self, coded: Shapes) -> np.ndarray:
        """How many values share each scale: a whole tensor, or one output channel of it."""
        lengths: list[int] = []
        for _, shape in coded:
            if self.per_channel and len(shape) >= 2:
                lengths += [math.prod(shape[1:])] * shape[0]
            else:
                lengths.append(math.prod(shape))
        return np.array(lengths, np.int64)

    def encode_values(self, values: np.ndarray, coded: Shapes) -> NamedArrays:
        lengths = self.row_lengths(coded)
        scale = np.zeros(lengths.size, np.float32)
        if values.size:
            rows = lengths > 0
            scale[rows] = np.maximum.reduceat(np.abs(values), starts(lengths)[rows]) / np.float32(127)
        each = np.repeat(scale, lengths)
        quantized = np.rint(values / np.where(each > 0, each, np.float32(1)))
        return {VALUES: np.clip(quantized, -127, 127).astype(np.int8), SCALES: scale}

    def decode_values(self, payload: Mapping[str, np.ndarray], coded: Shapes) -> np.ndarray:
        lengths = self.row_lengths(coded)
        scale = scales(payload, SCALES, lengths.size, "int8 scales")
        return field(payload, VALUES, np.int8, size(coded)) * np.repeat(scale, lengths)
