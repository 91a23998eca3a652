"""The classifier trainer: SGD or AdamW (optionally DP-SGD through Opacus) of a PyTorch CNN or MLP on an ``.npz``.

With a local test split (``agent.test_data``) it evaluates the model it starts from on it (the agent's C-SPE,
its start model on its own test data) and, once trained, the model it is judged by (trained C-SPE, the seeds'
metric); both are reported with its update. The round's recipes
(``participant.recipes``) shape the rest: a proximal pull, partial work, FedAMN's meta-network before the base
network trains, Ditto's personal model after."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from flcore.update import TrainResult
from models.datasets import Dataset
from models.own import is_reference, model_refusal
from models.training import evaluate, seed_training, train_sgd
from models.weights import NamedArrays, load_arrays, spec_mismatch, state_spec, to_arrays
from models.zoo import build_model
from participant.declined import TrainingDeclined
from participant.local_dp import PrivacyBudget, dp_sgd
from participant.momentum import MomentumStore
from participant.recipes import LocalRun, knobs_of, recipes_for
from participant.trainer import PeerContext
from protocol.messages import RoundTask


def round_seed(seed: int, agent_id: str, round_number: int) -> int:
    """The seed of an agent's batch order and dropout in a round: its own in every round, repeatable from its
    configured ``seed`` (benchmarks.flower trains Flower's clients with it, so both see the same batches)."""
    return seed * 1_000_003 + zlib.crc32(agent_id.encode()) + round_number


class ClassifierTrainer:
    """SGD with momentum (or AdamW) on this agent's dataset, with the round's epochs, batch size, learning rate
    and optimizer."""

    def __init__(
        self,
        data: Dataset,
        *,
        device: torch.device,
        agent_id: str,
        work_dir: Path,
        seed: int = 0,
        budget: PrivacyBudget | None = None,
        test_data: Dataset | None = None,
        model: str = "",
    ) -> None:
        self.data = data
        self.model = model  # the model the agent's own config names ("" = any zoo model a task names)
        self.test_data = test_data  # the local test split (agent.test_data): never trained on
        self.momentum = MomentumStore(work_dir)
        self.device = device
        self.agent_id = agent_id
        self.seed = seed
        self.budget = budget  # DP-SGD (participant.local_dp) when given
        self.work_dir = work_dir  # where recipes keep what lasts across rounds
        self._spare: dict[tuple[str, int], torch.nn.Module] = {}  # the last round's model, to load the next into

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        if self.budget is not None and (refusal := self.budget.refusal(task, self.agent_id)):
            raise TrainingDeclined(refusal)
        settings = task.train_of(self.agent_id)
        recipes = recipes_for(settings, "classifier")
        model = self._build(task, global_arrays)
        seed = round_seed(self.seed, self.agent_id, task.round)
        run = LocalRun(model, global_arrays, self.data, self.test_data, settings, knobs_of(recipes), self.device,
                       task.round, seed, self.work_dir, self.budget is not None, context)
        if self.test_data is not None:
            run.start_eval = evaluate(model, self.test_data, self.device)  # C-SPE
        seed_training(run.seed)
        for recipe in recipes:
            recipe.before(run)
        prepare, spent = dp_sgd(self.budget.policy) if self.budget is not None else (None, None)
        outcome = train_sgd(
            model,
            self.data,
            epochs=settings.epochs,
            batch_size=settings.batch_size,
            lr=settings.lr,
            momentum=settings.momentum,
            seed=run.seed,
            device=self.device,
            prox_mu=0.0 if prepare is not None else run.knobs.prox_mu,  # a whole-model term has no per-sample gradient
            work=run.knobs.work,
            prepare=prepare,
            momentum_start=self.momentum.start(task, settings),
            optimizer=settings.optimizer,
            anchor=run.anchor,
        )
        self.momentum.keep(task, settings, outcome.momentum)
        for recipe in recipes:
            recipe.after(run)
        trained_eval = {} if self.test_data is None else evaluate(run.judged_model, self.test_data, self.device)
        epsilon = None
        if self.budget is not None and spent is not None:
            self.budget.spend(spent(), settings)
            epsilon = self.budget.epsilon
        result = TrainResult(arrays=to_arrays(model), samples=outcome.samples, loss=outcome.loss, epsilon=epsilon,
                             start_eval=run.start_eval, trained_eval=trained_eval)  # fmt: skip
        self._keep(task, model)
        return result

    def _keep(self, task: RoundTask, model: torch.nn.Module) -> None:
        """Keep the trained module for the next round to load its start into: building one was a sixth of a small
        model's round on an agent (cProfile). Not after DP-SGD (Opacus hooks the module), nor an operator's own model
        (``models.own``: what it keeps outside its state_dict would carry over into the next round)."""
        if self.budget is None and not is_reference(task.model):
            model.zero_grad(set_to_none=True)
            self._spare[(task.model, task.num_classes)] = model

    def _build(self, task: RoundTask, global_arrays: NamedArrays) -> torch.nn.Module:
        """The task's model (last round's module, else a new one) with the global weights, declined (with the reason
        the server's monitor shows) when it is not this agent's to build or its layout differs: the state_dict's
        names and shapes are the contract."""
        if refusal := model_refusal(task.model, self.model):
            raise TrainingDeclined(refusal)
        if (top := int(self.data.y.max())) >= task.num_classes:
            raise TrainingDeclined(f"label-range: this agent's data holds label {top}, the federation's model has "
                                   f"{task.num_classes} classes")  # fmt: skip
        model = self._spare.pop((task.model, task.num_classes), None)  # taken: a second training builds its own
        if model is None:
            model = build_model(task.model, num_classes=task.num_classes)
        if problem := spec_mismatch(global_arrays, state_spec(model)):
            raise TrainingDeclined(f"layout-mismatch: the global model against this agent's {task.model}: "
                                   f"{problem}")  # fmt: skip
        load_arrays(model, global_arrays)
        return model
