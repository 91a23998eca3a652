"""Malicious agents for robustness experiments (``skyfed sim --attackers K --attack KIND``).

An attacker is the real agent daemon, enrolled with its own real keys, whose trainer lies: it trains
honestly, then reports something else. KIND is one of

* ``sign-flip`` — sends −delta (pushes the model away from where its data points);
* ``scale:F`` — sends F x delta (model replacement / boosting);
* ``noise:SIGMA`` — sends Gaussian noise N(0, SIGMA²) in place of the delta;
* ``samples:N`` — sends its honest delta but claims N training samples;
* ``KIND+samples:N`` — any of the above with a claim of N samples besides (``scale:-20+samples:1e12``:
  a reversed, boosted step that also claims most of the weight);
* ``silent`` — trains, reports itself healthy (``done``), and never sends its update
  (``SilentAgent``): an enrolled device that costs rounds their deadline unless the server backs it off.

``scope`` says what is attacked: ``parameters`` (default) changes only the trainable parameters — what
the textbook attacks act on, as they are defined on gradients — and reports BatchNorm's running
statistics honestly; ``all`` changes every floating tensor, running statistics included (a negated or
noisy running variance is easy to spot: the server refuses an update that makes one negative).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np

from agent.daemon import EdgeAgent
from flcore.update import TrainResult
from models.weights import NamedArrays, is_float
from models.zoo import build_model
from participant.trainer import PeerContext, Trainer, TrainerWrapper
from protocol.messages import RoundTask

KINDS = ("sign-flip", "scale", "noise", "samples", "silent")
NO_VALUE = ("sign-flip", "silent")
SCOPES = ("parameters", "all")


@dataclass(frozen=True)
class Attack:
    kind: str
    value: float = 0.0
    claim: int = 0  # samples claimed besides the attack on the weights (``KIND+samples:N``; 0: honest claim)

    @classmethod
    def parse(cls, spec: str) -> Attack:
        main, plus, extra = spec.partition("+")
        attack = cls._one(main, spec)
        if not plus:
            return attack
        claim = cls._one(extra, spec)
        if claim.kind != "samples" or attack.kind in ("samples", "silent"):
            raise ValueError(f"--attack {spec!r}: only +samples:N may follow, after sign-flip, scale:F or noise:SIGMA")
        return replace(attack, claim=int(claim.value))

    @classmethod
    def _one(cls, part: str, spec: str) -> Attack:
        kind, _, value = part.partition(":")
        if kind not in KINDS or (kind in NO_VALUE) != (value == ""):
            raise ValueError(f"--attack {spec!r} must be sign-flip, scale:F, noise:SIGMA, samples:N or silent "
                             "(+samples:N may follow)")  # fmt: skip
        try:
            attack = cls(kind, float(value) if value else 0.0)
        except ValueError:
            raise ValueError(f"--attack {spec!r}: {value!r} is not a number") from None
        if kind in ("noise", "samples") and attack.value <= 0:
            raise ValueError(f"--attack {spec!r}: the value must be > 0")
        return attack

    def __str__(self) -> str:
        text = self.kind if self.kind in NO_VALUE else f"{self.kind}:{self.value:g}"
        return f"{text}+samples:{self.claim}" if self.claim else text


def poisoned(
    local: NamedArrays, base: NamedArrays, attack: Attack, rng: np.random.Generator, targets: set[str] | None = None
) -> NamedArrays:
    """The weights an attacker reports instead of ``local`` (trained from ``base``); only the floating
    tensors named in ``targets`` are changed (all floating ones when None)."""
    out = {}
    for name, value in local.items():
        if not is_float(value) or (targets is not None and name not in targets):
            out[name] = value
            continue
        honest = value.astype(np.float32) - base[name].astype(np.float32)
        if attack.kind == "sign-flip":
            bad = -honest
        elif attack.kind == "scale":
            bad = np.float32(attack.value) * honest
        elif attack.kind == "noise":
            bad = rng.normal(0.0, attack.value, honest.shape).astype(np.float32)
        else:
            bad = honest
        out[name] = (base[name].astype(np.float32) + bad).astype(value.dtype)
    return out


class AttackingTrainer(TrainerWrapper):
    """Wraps an honest trainer and applies ``attack`` to what it reports."""

    def __init__(self, inner: Trainer, attack: Attack, agent_id: str, scope: str = "parameters") -> None:
        if scope not in SCOPES:
            raise ValueError(f"--attack-scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        super().__init__(inner)
        self.attack = attack
        self.scope = scope
        self.seed = zlib.crc32(agent_id.encode())

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        honest = self.inner.train(global_arrays, task, context)
        if self.attack.kind == "samples":
            return replace(honest, samples=int(self.attack.value))
        rng = np.random.default_rng([self.seed, task.round])
        targets = None
        if self.scope == "parameters":
            targets = {name for name, _ in build_model(task.model, num_classes=task.num_classes).named_parameters()}
        arrays = poisoned(honest.arrays, global_arrays, self.attack, rng, targets)
        return replace(honest, arrays=arrays, samples=self.attack.claim or honest.samples)


class SilentAgent(EdgeAgent):
    """An agent daemon that trains and says ``done`` but never sends its update (``--attack silent``)."""

    def _send(self, task: RoundTask, data: bytes) -> None:
        self.client.record_sent(task.round, task.attempt)  # as if acknowledged
        self._set_state("done", publish=True)
