"""The classifier trainer: SGD or AdamW (optionally DP-SGD through Opacus) of a PyTorch CNN or MLP on an ``.npz``.

With a local test split (``agent.test_data``) it first evaluates the model it starts from on it: that is
the agent's C-SPE (its start model on its own test data), reported with its update. Under FedAMN (a
``PeerContext``) the attention meta-network (``participant.meta_attention``) is trained next, on the agent's own
data, and the base network trains from its output (seed 003's alternating training)."""

from __future__ import annotations

import logging
import time
import zlib
from pathlib import Path

import torch

from flcore.update import TrainResult
from models.datasets import Dataset
from models.own import model_refusal
from models.training import evaluate, seed_training, train_sgd
from models.weights import NamedArrays, load_arrays, spec_mismatch, state_spec, to_arrays
from models.zoo import build_model
from participant.local_dp import PrivacyBudget, dp_sgd
from participant.meta_attention import attention_start
from participant.momentum import MomentumStore
from participant.trainer import PeerContext, TrainingDeclined
from protocol.messages import RoundTask, TrainSettings

META_STATE_FILE = "meta_attention.safetensors"
log = logging.getLogger("skyfed.agent")


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
        self.seed_base = seed * 1_000_003 + zlib.crc32(agent_id.encode())
        self.budget = budget  # DP-SGD (participant.local_dp) when given
        self.meta_state = work_dir / META_STATE_FILE  # FedAMN's meta-network parameters, kept across rounds

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        if self.budget is not None and (refusal := self.budget.refusal(task, self.agent_id)):
            raise TrainingDeclined(refusal)
        if self.budget is not None and context is not None:
            raise TrainingDeclined("local DP-SGD does not cover FedAMN's attention meta-network, which also "
                                   "trains on this agent's data: run fedamn without [privacy] local DP")  # fmt: skip
        model = self._build(task, global_arrays)
        start_eval = evaluate(model, self.test_data, self.device) if self.test_data is not None else {}  # C-SPE
        seed_training(self.seed_base + task.round)
        settings = task.train_of(self.agent_id)
        if context is not None:
            self._attend(model, global_arrays, context, task, settings)
        prepare, spent = dp_sgd(self.budget.policy) if self.budget is not None else (None, None)
        outcome = train_sgd(
            model,
            self.data,
            epochs=settings.epochs,
            batch_size=settings.batch_size,
            lr=settings.lr,
            momentum=settings.momentum,
            seed=self.seed_base + task.round,
            device=self.device,
            prox_mu=0.0 if prepare is not None else settings.prox_mu,  # a whole-model term has no per-sample gradient
            work=settings.work,
            prepare=prepare,
            momentum_start=self.momentum.start(task, settings),
            optimizer=settings.optimizer,
        )
        self.momentum.keep(task, settings, outcome.momentum)
        epsilon = None
        if self.budget is not None and spent is not None:
            self.budget.spend(spent(), settings)
            epsilon = self.budget.epsilon
        return TrainResult(arrays=to_arrays(model), samples=outcome.samples, loss=outcome.loss, epsilon=epsilon,
                           start_eval=start_eval)

    def _build(self, task: RoundTask, global_arrays: NamedArrays) -> torch.nn.Module:
        """The task's model with the global weights, declined (with the reason the server's monitor shows) when
        it is not this agent's to build or its layout differs: the state_dict's names and shapes are the contract."""
        if refusal := model_refusal(task.model, self.model):
            raise TrainingDeclined(refusal)
        if (top := int(self.data.y.max())) >= task.num_classes:
            raise TrainingDeclined(f"label-range: this agent's data holds label {top}, the federation's model has "
                                   f"{task.num_classes} classes")  # fmt: skip
        model = build_model(task.model, num_classes=task.num_classes)
        if problem := spec_mismatch(global_arrays, state_spec(model)):
            raise TrainingDeclined(f"layout-mismatch: the global model against this agent's {task.model}: "
                                   f"{problem}")  # fmt: skip
        load_arrays(model, global_arrays)
        return model

    def _attend(
        self, model: torch.nn.Module, own: NamedArrays, context: PeerContext, task: RoundTask, settings: TrainSettings
    ) -> None:
        """FedAMN's meta-network step: train it on this agent's data, then load its output into ``model``."""
        started = time.perf_counter()
        arrays, report = attention_start(model, own, context.peers, context.global_model, self.data,
                                         epochs=settings.meta_epochs, lr=settings.meta_lr,
                                         batch_size=settings.batch_size, seed=self.seed_base + task.round,
                                         device=self.device, state_path=self.meta_state)  # fmt: skip
        load_arrays(model, arrays)
        log.info("attention round=%d peers=%d top_peer_weight=%.3f global_weight=%.3f meta_loss=%.4f seconds=%.2f",
                 task.round, len(report.peer_weights), max(report.peer_weights), report.global_weight, report.loss,
                 time.perf_counter() - started)  # fmt: skip
