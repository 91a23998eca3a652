"""How much an update trained from an older model counts: the staleness functions of asynchronous FL.

Staleness ``s`` is how many model versions were published between the one an update was trained from and the one
it is folded into. Its weight is multiplied by ``f(s)``, with ``f(0) = 1`` (Xie, Koyejo & Gupta, "Asynchronous
Federated Optimization", 2019, arXiv:1903.03934, section 5; FedBuff, Nguyen et al., AISTATS 2022, uses the
polynomial form with a = 1/2):

* ``constant``: every update counts fully, ``f(s) = 1``;
* ``polynomial:a``: ``f(s) = (1 + s)^-a``;
* ``hinge:a,b``: ``f(s) = 1`` while ``s <= b``, then ``1 / (a (s - b) + 1)``.

A synchronous round's late update of the round before uses a fixed factor (``strategy.late_weight``, ``flcore.late``):
``Staleness.fixed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("constant", "polynomial", "hinge")
DEFAULT_STALENESS = "polynomial:0.5"  # FedBuff's choice (Nguyen et al., 2022, section 5)


@dataclass(frozen=True)
class Staleness:
    kind: str = "constant"
    a: float = 0.0
    b: float = 0.0
    late: float = 1.0  # ``fixed``: the factor of any late update (s >= 1)

    @classmethod
    def parse(cls, text: object, *, where: str = "rounds.staleness") -> Staleness:
        """``constant``, ``polynomial:a`` or ``hinge:a,b``; ``ValueError`` naming ``where`` otherwise."""
        usage = (f'{where} must be "constant", "polynomial:a" (a > 0, weight (1 + s)^-a) or "hinge:a,b" (a > 0, '
                 f"b >= 0: weight 1 up to s = b, then 1 / (a (s - b) + 1)), s the versions an update is behind; "
                 f"got {text!r}")  # fmt: skip
        if not isinstance(text, str):
            raise ValueError(usage)
        kind, _, args = text.strip().partition(":")
        try:
            values = [float(v) for v in args.split(",")] if args else []
        except ValueError:
            raise ValueError(usage) from None
        wanted = {"constant": 0, "polynomial": 1, "hinge": 2}.get(kind)
        if wanted is None or len(values) != wanted or not all(math.isfinite(v) for v in values):
            raise ValueError(usage)
        if values and (values[0] <= 0 or (kind == "hinge" and values[1] < 0)):
            raise ValueError(usage)
        return cls(kind, *values)

    @classmethod
    def fixed(cls, late: float) -> Staleness:
        return cls("fixed", late=late)

    def weight(self, staleness: int) -> float:
        """``f(staleness)``: 1 for an update of the model in force; ``fixed``: its factor for any late update."""
        s = max(0, staleness)
        if self.kind == "fixed":
            return self.late
        if s == 0 or self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return (1.0 + s) ** -self.a
        return 1.0 if s <= self.b else 1.0 / (self.a * (s - self.b) + 1.0)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.late:g}"
        args = [self.a, self.b][: {"constant": 0, "polynomial": 1, "hinge": 2}[self.kind]]
        return self.kind + (":" + ",".join(f"{v:g}" for v in args) if args else "")
