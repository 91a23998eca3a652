"""``compress``, what the agent calls: encode a change and, with an ``ErrorFeedback`` and a codec that declares
``error_feedback`` (top-k), keep the unsent remainder on disk for the next round (Stich et al. 2018,
"Sparsified SGD with memory"). int8 gained nothing measurable from it (docs/results/codecs.md), and it
costs a model-sized durable write per round on the agent, so a codec asks for it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from common.files import atomic_write
from protocol.codecs.base import ChosenCodec, NamedArrays, Shapes

RESIDUAL_FORMAT = "skyfed.residual/1"


@dataclass(frozen=True)
class Compressed:
    payload: NamedArrays  # what the update carries (``UpdateMeta.codec = str(codec)``)
    sent: NamedArrays  # float32, what the server decodes: the agent's model after the round is start + sent


@dataclass(frozen=True)
class ErrorFeedback:
    """The part of an agent's past changes its codec has not sent yet, kept in ``path`` (mode 0600,
    replaced atomically) so it survives a restart. It belongs to one server run (``run_id``, from the
    round task), one codec and one set of tensor names and shapes; under anything else it starts at zero."""

    path: Path
    run_id: str

    def scope(self, codec: ChosenCodec, shapes: Shapes) -> str:
        return hashlib.sha256(json.dumps([self.run_id, str(codec), sorted(shapes)]).encode()).hexdigest()

    def residual(self, scope: str, shapes: Shapes) -> NamedArrays:
        """The kept residual, or zeros if there is none for ``scope`` (none yet, another run or model, or
        an unreadable file: losing a residual only delays what it held)."""
        try:
            with safe_open(self.path, framework="np") as handle:
                if (handle.metadata() or {}) == {"format": RESIDUAL_FORMAT, "scope": scope}:
                    return {name: handle.get_tensor(name) for name, _ in shapes}
        except (FileNotFoundError, SafetensorError):
            pass
        return {name: np.zeros(shape, np.float32) for name, shape in shapes}

    def keep(self, scope: str, residual: NamedArrays) -> None:
        """Store ``residual``; a non-finite one (a diverged change) is dropped rather than carried forever."""
        if not all(np.isfinite(r).all() for r in residual.values()):
            residual = {name: np.zeros_like(r) for name, r in residual.items()}
        atomic_write(self.path, save(residual, metadata={"format": RESIDUAL_FORMAT, "scope": scope}), mode=0o600)


def compress(change: Mapping[str, np.ndarray], codec: ChosenCodec, feedback: ErrorFeedback | None = None) -> Compressed:
    """Encode ``change``; with ``feedback`` and a codec that uses it, what earlier rounds did not send is
    added first and what this payload does not send is kept: ``corrected = change + residual``,
    ``residual = corrected - sent``, so the server receives every change eventually."""
    shapes = tuple((name, tuple(a.shape)) for name, a in change.items())
    if feedback is None or not codec.feedback:
        payload = codec.plugin.encode(change)
        return Compressed(payload, codec.plugin.decode(payload, shapes))
    scope = feedback.scope(codec, shapes)
    residual = feedback.residual(scope, shapes)
    corrected = {name: np.add(change[name], residual[name], dtype=np.float32) for name, _ in shapes}
    payload = codec.plugin.encode(corrected)
    sent = codec.plugin.decode(payload, shapes)
    feedback.keep(scope, {name: corrected[name] - sent[name] for name, _ in shapes})
    return Compressed(payload, sent)
