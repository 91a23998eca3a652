"""The recipe interface: what a strategy adds to a participant's local training (docs/architecture.md, "Recipes").

A round task's ``TrainSettings.recipes`` lists ``RecipeRecord``s (name, version, options); each names a
``Recipe`` registered in ``participant.recipes``. A trainer builds them before it trains (an unknown name, another
version or bad options decline the round with the reason) and lets each act at three points:

- ``knobs``: the plain SGD loop's own settings: a proximal pull toward the start model, the share of the local
  work (``Knobs``);
- ``before``: after the start model is built and the participant's C-SPE measured, before it trains (FedAMN's
  meta-network replaces the start model; Ditto measures its personal model instead);
- ``after``: once the model to upload is trained (Ditto trains its personal model).

Modules of recipes import PyTorch inside their hooks only: the agent's daemon and the server check records
without loading it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from models.datasets import Dataset
from models.weights import NamedArrays

log = logging.getLogger("skyfed.agent")


@dataclass(frozen=True)
class Knobs:
    """What recipes set of the plain SGD loop (``models.training.train_sgd``)."""

    prox_mu: float = 0.0  # μ of the proximal term (μ/2)·‖w − w_start‖² (0: none)
    work: float = 1.0  # the share of the epochs' mini-batches to run


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass
class LocalRun:
    """One round of local training as the recipes see it. ``model`` is the PyTorch module that trains and is
    uploaded; ``start`` the round's start model; ``start_eval`` the scores reported as this participant's C-SPE
    (its model on its own test split before it trains); ``judged`` the module the participant is judged by after
    training, when that is not ``model`` (Ditto's personal model); ``state_dir`` where a recipe keeps what lasts
    across rounds; ``context`` the models sent beside the start (``participant.trainer.PeerContext``: FedAMN's
    cluster mates, FedAMP's cloud model) or None; ``anchor`` what a recipe has the proximal term pull toward instead
    of the start."""

    model: Any
    start: NamedArrays
    data: Dataset
    test_data: Dataset | None
    settings: Any  # protocol.messages.TrainSettings
    knobs: Knobs
    device: Any
    round: int
    seed: int
    state_dir: Path
    private: bool = False  # local DP-SGD trains the uploaded model
    context: Any = None
    start_eval: dict[str, float] = field(default_factory=dict)
    anchor: NamedArrays | None = None  # what the proximal pull aims at (None: the start model)
    judged: Any = None

    @property
    def judged_model(self) -> Any:
        return self.model if self.judged is None else self.judged


class Recipe:
    """Base class: override what the recipe changes. ``Options`` is validated from the record's options with the
    key named (``protocol.typed.build``); ``trainers`` are the trainers (``training.trainer``) that can follow it."""

    name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    Options: ClassVar[type] = NoOptions
    trainers: ClassVar[frozenset[str]] = frozenset({"classifier"})

    def __init__(self, options: Any) -> None:
        self.options = options

    def knobs(self, knobs: Knobs) -> Knobs:
        return knobs

    def before(self, run: LocalRun) -> None:  # noqa: B027 - optional hook
        """After the start model is built and C-SPE measured; before training."""

    def after(self, run: LocalRun) -> None:  # noqa: B027 - optional hook
        """After the model to upload is trained."""


def kept_arrays(path: Path, expected: Mapping[str, np.ndarray], what: str) -> NamedArrays:
    """What a recipe kept at ``path`` across rounds (Ditto's personal model, FedPer's head) if it has exactly
    ``expected``'s tensors and shapes and only finite values; else nothing, logged, and the recipe starts ``what``
    again from the round's model."""
    from models.serialization import SerializationError, load_file

    if not path.exists():
        return {}
    try:
        arrays, _ = load_file(path)
    except SerializationError as exc:
        log.warning("%s %s unreadable (%s): starting it from the round's model", what, path, exc)
        return {}
    fits = set(arrays) == set(expected) and all(arrays[n].shape == expected[n].shape for n in expected)
    if not fits or not all(np.isfinite(a).all() for a in arrays.values()):
        log.warning("%s %s does not fit the round's model: starting it from the round's model", what, path)
        return {}
    return arrays
