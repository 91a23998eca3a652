"""FedPer's client half (Arivazhagan et al. 2019, arXiv:1912.00818; ``flcore.strategies.fedper``): the participant
keeps its personal head (the model's last ``layers`` Linear layers, ``flcore.strategies.fedper.personal_head``) on
disk and loads it over the round's model before it trains, so body and head train together from the federation's
body and its own head; its C-SPE is that model on its own test split before it trains, its trained C-SPE the trained
body with the trained head. After training it keeps the
trained head and puts the round's head back into the model it uploads: the update's head change is exactly zero,
and the head never leaves the participant. A kept head that is missing, of another layout or not finite starts
again from the round's head (the initial one in a federation's first round)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from participant.recipes.base import LocalRun, Recipe, kept_arrays

HEAD_FILE = "fedper_head.safetensors"
log = logging.getLogger("skyfed.agent")


@dataclass(frozen=True)
class HeadOptions:
    layers: int = 1  # the model's last Linear layers that are the personal head

    def __post_init__(self) -> None:
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"layers must be a whole number >= 1, got {self.layers!r}")


class PersonalHead(Recipe):
    name = "fedper"
    Options = HeadOptions

    def before(self, run: LocalRun) -> None:
        """The kept head over the round's body, in the network that trains, and its C-SPE."""
        from flcore.strategies.fedper import personal_head
        from models.training import evaluate
        from models.weights import load_arrays, state_spec
        from participant.declined import TrainingDeclined

        try:
            self.head = personal_head(((s.name, s.shape) for s in state_spec(run.model)), self.options.layers)
        except ValueError as exc:
            raise TrainingDeclined(f"recipe-refused: {exc}") from None
        own = kept_arrays(run.state_dir / HEAD_FILE, {n: run.start[n] for n in self.head}, "personal head")
        load_arrays(run.model, {**run.start, **own})
        if run.test_data is not None:
            run.start_eval = evaluate(run.model, run.test_data, run.device)

    def after(self, run: LocalRun) -> None:
        from models.serialization import save_file
        from models.weights import load_arrays, to_arrays

        trained = to_arrays(run.model)
        save_file(run.state_dir / HEAD_FILE, {n: trained[n] for n in self.head})
        run.judged = copy.deepcopy(run.model)  # trained body and own head: what its trained C-SPE scores
        load_arrays(run.model, {**trained, **{n: run.start[n] for n in self.head}})  # the upload: no head change
        log.info("personal head kept round=%d tensors=%s", run.round, ",".join(self.head))
