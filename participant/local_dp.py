"""Local differential privacy on the agent: DP-SGD through Opacus (record-level), with a durable budget.

For an aggregator the agent does not trust, or a fleet too small for central noise to be affordable:
every mini-batch gradient is clipped per sample to ``max_grad_norm`` and Gaussian noise of standard
deviation ``noise_multiplier × max_grad_norm`` is added before the step (Abadi et al. 2016, "Deep
Learning with Differential Privacy"). Batches are Poisson-sampled on the device (each record with
probability batch_size / N), a choice nobody else sees, so Opacus' RDP accountant may count the
sampling amplification. The guarantee covers one record of this agent's data against everyone who sees
its updates, the server included; it says nothing about the agent's data as a whole (that is central
DP's user-level guarantee, ``docs/privacy.md``).

The accountant's history (noise multiplier, sample rate, steps) lives in ``<state_dir>/privacy.json``,
written before the update leaves the device, so a restart never forgets spent budget. With
``target_epsilon`` the agent stops volunteering (its gate closes, so the server stops selecting it)
once another round like the last would pass the target, and it never trains a round that would.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from common.files import read_json, write_json
from participant.recipes import work_share
from protocol.messages import RoundTask, TrainSettings

if TYPE_CHECKING:
    from models.training import Prepare

Step = tuple[float, float, int]  # (noise multiplier, sample rate, steps), as Opacus' accountant keeps them


@dataclass(frozen=True)
class LocalPrivacySection:
    """``[privacy]`` of ``agent.toml``: DP-SGD when ``noise_multiplier`` > 0."""

    noise_multiplier: float = 0.0
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    target_epsilon: float = 0.0  # 0 = no budget (epsilon is still reported)

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0:
            raise ValueError(f"privacy.noise_multiplier must be >= 0 (0 = off), got {self.noise_multiplier}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"privacy.max_grad_norm must be > 0 (the per-sample clip), got {self.max_grad_norm}")
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy.delta must be in (0, 1), e.g. 1e-5, got {self.delta}")
        if self.target_epsilon < 0:
            raise ValueError(f"privacy.target_epsilon must be >= 0 (0 = no budget), got {self.target_epsilon}")
        if self.target_epsilon and not self.noise_multiplier:
            raise ValueError("privacy.target_epsilon needs privacy.noise_multiplier > 0: without noise there is "
                             "no finite epsilon to budget")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.noise_multiplier > 0


def steps_of(train: TrainSettings, samples: int) -> tuple[float, int]:
    """``(sample rate, steps)`` of one round with these settings, at most: Poisson sampling at rate
    batch/N for the number of batches the round's epochs (and a partial-work recipe's share) take."""
    batches = math.ceil(samples / train.batch_size)
    return min(1.0, train.batch_size / samples), max(1, math.ceil(work_share(train) * train.epochs * batches))


def merged(history: list[Step]) -> tuple[Step, ...]:
    """Steps at the same (noise multiplier, sample rate) compose into one entry: RDP adds up, and the
    accountant's cost grows with entries, not steps (half a second each)."""
    steps: dict[tuple[float, float], int] = {}
    for noise, rate, count in history:
        steps[(noise, rate)] = steps.get((noise, rate), 0) + int(count)
    return tuple((noise, rate, count) for (noise, rate), count in steps.items())


def epsilon_of(history: list[Step], delta: float) -> float:
    return _epsilon(merged(history), delta)


@lru_cache(maxsize=64)
def _epsilon(history: tuple[Step, ...], delta: float) -> float:
    from opacus.accountants import RDPAccountant

    if not history:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta))


def dp_sgd(policy: LocalPrivacySection) -> tuple[Prepare, Callable[[], list[Step]]]:
    """Opacus' DP-SGD for one round: the ``prepare`` hook for ``train_sgd`` (per-sample clipping, noise,
    Poisson sampling) and a function that returns what the round spent, once it has run."""
    from opacus import PrivacyEngine

    with warnings.catch_warnings():  # "Secure RNG turned off": said once in docs/privacy.md, not every round
        warnings.simplefilter("ignore", UserWarning)
        engine = PrivacyEngine(accountant="rdp")

    def prepare(model, optimizer, loader):  # noqa: ANN001, ANN202 - the types of models.training.Prepare
        # Opacus' per-sample hooks fire on a first layer whose input needs no gradient; PyTorch warns about
        # that once per process, which is expected here and only noise in the journal.
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        return engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=policy.noise_multiplier,
            max_grad_norm=policy.max_grad_norm,
            poisson_sampling=True,
        )

    return prepare, lambda: [tuple(step) for step in engine.accountant.history]  # type: ignore[misc]


@lru_cache(maxsize=16)
def incompatibility(model_name: str, num_classes: int) -> str:
    """Why Opacus cannot compute per-sample gradients for this model ('' when it can). BatchNorm mixes
    the samples of a batch, so a model with it cannot be trained record-private as it is."""
    from opacus.validators import ModuleValidator

    from models.zoo import build_model

    errors = ModuleValidator.validate(build_model(model_name, num_classes), strict=False)
    if not errors:
        return ""
    return (f"local-dp-incompatible-model: {model_name} cannot be trained with DP-SGD ({errors[0]}); the federation "
            "needs a model without BatchNorm, e.g. mlp_digits or fedavg_cnn")  # fmt: skip


def budget_for(policy: LocalPrivacySection, state_dir: Path, samples: int) -> PrivacyBudget | None:
    """The agent's budget when ``[privacy]`` turns DP-SGD on, else None."""
    return PrivacyBudget(policy, state_dir / "privacy.json", samples) if policy.enabled else None


class PrivacyBudget:
    """This agent's own (epsilon, delta) over every round it trained, kept on disk."""

    def __init__(self, policy: LocalPrivacySection, path: Path, samples: int) -> None:
        self.policy = policy
        self.path = path
        self.samples = samples
        self.history: list[Step] = [tuple(s) for s in read_json(path)["history"]] if path.exists() else []  # type: ignore[misc]
        self.epsilon = epsilon_of(self.history, policy.delta)
        self.last_train: TrainSettings | None = None

    def planned(self, train: TrainSettings) -> Step:
        return (self.policy.noise_multiplier, *steps_of(train, self.samples))

    def refusal(self, task: RoundTask | None, agent: str) -> str:
        """Why this agent will not train ``task`` (or, without one, another round like its last), or ''."""
        if task is not None and (why := incompatibility(task.model, task.num_classes)):
            return why
        target = self.policy.target_epsilon
        train = task.train_of(agent) if task is not None else self.last_train
        if not target or train is None:
            return ""
        after = epsilon_of([*self.history, self.planned(train)], self.policy.delta)
        if after <= target:
            return ""
        return f"privacy-budget-spent: epsilon {self.epsilon:.3g} of {target:g}; the next round would reach {after:.3g}"

    def spend(self, steps: list[Step], train: TrainSettings) -> None:
        """Record what a finished training spent (before its update is sent), and whether another round like
        it would pass the target (``gate``: the daemon's status reads it, ``agent.profile.PrivacyView``)."""
        self.history = list(merged([*self.history, *steps]))
        self.epsilon = epsilon_of(self.history, self.policy.delta)
        self.last_train = train
        record = {"history": [list(s) for s in self.history], "epsilon": self.epsilon, "gate": self.refusal(None, "")}
        write_json(self.path, record, mode=0o600)
