"""Ditto's client half (Li et al., ICML 2021, Algorithm 1; ``flcore.strategies.ditto``): besides the model it
uploads, the participant keeps a personal model vₖ on disk and, once the round's model is trained, trains vₖ for
``epochs`` on min F_k(v) + (λ/2)·‖v − wᵗ‖², wᵗ the round's start model, with the round's optimizer settings. Its
C-SPE is vₖ on its own test split before it trains (the model it would use now), its trained C-SPE vₖ after. A
personal model that is missing, of another layout or not finite starts again from wᵗ. Local DP-SGD covers the
uploaded model; vₖ never leaves the participant."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from models.weights import NamedArrays
from participant.recipes.base import LocalRun, Recipe, kept_arrays

PERSONAL_FILE = "ditto_personal.safetensors"
log = logging.getLogger("skyfed.agent")


@dataclass(frozen=True)
class DittoOptions:
    lam: float = 0.1  # λ
    epochs: int = 1  # the personal model's epochs per round

    def __post_init__(self) -> None:
        if not self.lam >= 0 or self.epochs < 1:
            raise ValueError(f"lam must be >= 0 and epochs >= 1, got {self.lam} and {self.epochs}")


class Ditto(Recipe):
    name = "ditto"
    Options = DittoOptions

    def before(self, run: LocalRun) -> None:
        """The personal model in a copy of the round's network, taken before training (which may wrap the network
        for DP-SGD), and its C-SPE."""
        from models.training import evaluate
        from models.weights import load_arrays

        self.personal = copy.deepcopy(run.model)
        load_arrays(self.personal, {**run.start, **kept(run)})
        run.judged = self.personal
        if run.test_data is not None:
            run.start_eval = evaluate(self.personal, run.test_data, run.device)

    def after(self, run: LocalRun) -> None:
        from models.serialization import save_file
        from models.training import train_sgd
        from models.weights import to_arrays

        s = run.settings
        outcome = train_sgd(self.personal, run.data, epochs=self.options.epochs, batch_size=s.batch_size, lr=s.lr,
                            momentum=s.momentum, seed=run.seed + 1, device=run.device, prox_mu=self.options.lam,
                            optimizer=s.optimizer, anchor=run.start)  # fmt: skip
        save_file(run.state_dir / PERSONAL_FILE, to_arrays(self.personal))
        log.info("personal model trained round=%d lam=%g loss=%.4f", run.round, self.options.lam, outcome.loss)


def kept(run: LocalRun) -> NamedArrays:
    """The personal model on disk if it has the round's tensors, shapes and only finite values; else nothing."""
    return kept_arrays(run.state_dir / PERSONAL_FILE, run.start, "personal model")
