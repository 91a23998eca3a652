"""``qsgd4``: QSGD's stochastic quantization at 4 bits a value (Alistarh et al., NeurIPS 2017, "QSGD:
Communication-Efficient SGD via Gradient Quantization"), about 7.9x smaller than fp32.

Each tensor is cut into buckets of ``BUCKET`` values (the paper's bucketing: a scale per bucket keeps the
variance to ``min(d / s**2, sqrt(d) / s)`` times the bucket's squared norm instead of the model's). A
value x in a bucket of L2 norm ``v`` becomes ``v * sign(x) * l / S``, with the level l in 0..S drawn as
``floor(S |x| / v)`` plus one with probability the remainder, so its expectation is x exactly (unbiased:
no error feedback needed). Here S = 7: the signed level -7..7 (15 levels) fits one 4-bit nibble as
``l + 8``, two per byte, the first value in the low nibble.

Payload: ``@norms`` float32, one per bucket, finite and >= 0; ``@values`` uint8, ceil(n / 2) bytes, every
nibble in 1..15 and an odd count's last pad nibble 8 (level 0). A decoded value is at most its bucket's
norm in magnitude, so a forged finite norm cannot make an infinity; the server's norm check bounds it.

The rounding draws from a generator seeded by the coded values themselves (and ``seed``), so an encoding
is reproducible, as a simulation's seed promises, and two agents' draws are independent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protocol.codecs.base import VALUES, CodecError, CodecPlugin, NamedArrays, Shapes, field, scales, size, starts

NORMS = "@norms"
LEVELS = 7  # S: magnitudes 0..7, with the sign 15 levels in one nibble
ZERO = 8  # the nibble of level 0: nibble = level + ZERO
BUCKET = 512  # values per norm (the paper's bucket size)


def bucket_lengths(coded: Shapes) -> np.ndarray:
    """How many values share each norm: every tensor cut into ``BUCKET``-value pieces, the last one shorter."""
    lengths: list[int] = []
    for _, shape in coded:
        whole, rest = divmod(math.prod(shape), BUCKET)
        lengths += [BUCKET] * whole + ([rest] if rest else [])
    return np.array(lengths, np.int64)


@dataclass(frozen=True)
class QSGD4(CodecPlugin):
    name = "qsgd4"
    spellings = ("qsgd4",)
    fields = (NORMS, VALUES)
    seed: int = dataclasses.field(default=0, compare=False)  # mixed into each encoding's seed (a test's many draws)

    def encode_values(self, values: np.ndarray, coded: Shapes) -> NamedArrays:
        lengths = bucket_lengths(coded)
        squares = np.square(values, dtype=np.float64)
        norms = np.sqrt(np.add.reduceat(squares, starts(lengths))) if values.size else np.zeros(0)
        each = np.repeat(norms.astype(np.float32).astype(np.float64), lengths)
        ratio = np.fmin(np.abs(values) / np.where(each > 0, each, 1.0) * LEVELS, LEVELS)  # NaN (diverged): LEVELS
        digest = hashlib.sha256(values.tobytes()).digest()
        rng = np.random.default_rng([int.from_bytes(digest[:8], "little"), self.seed])
        level = np.floor(ratio) + (rng.random(values.size) < ratio - np.floor(ratio))
        nibbles = (np.where(values < 0, -level, level) + ZERO).astype(np.uint8)
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(ZERO))
        return {NORMS: norms.astype(np.float32), VALUES: nibbles[0::2] | (nibbles[1::2] << 4)}

    def decode_values(self, payload: Mapping[str, np.ndarray], coded: Shapes) -> np.ndarray:
        n, lengths = size(coded), bucket_lengths(coded)
        norms = scales(payload, NORMS, lengths.size, "qsgd4 norms")
        packed = field(payload, VALUES, np.uint8, (n + 1) // 2)
        nibbles = np.stack([packed & 15, packed >> 4], axis=1).reshape(-1)
        if n % 2 and nibbles[-1] != ZERO:
            raise CodecError(f"qsgd4 pad nibble must be {ZERO} (level 0)")
        if not nibbles.all():
            raise CodecError(f"qsgd4 levels must be in [-{LEVELS}, {LEVELS}] (nibble 0 is none)")
        levels = nibbles[:n].astype(np.float64) - ZERO
        return (levels * np.repeat(norms.astype(np.float64), lengths) / LEVELS).astype(np.float32)
