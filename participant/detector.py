"""The detector trainer: Ultralytics YOLO training on this agent's YOLO dataset, one round at a time.

Federated use of Ultralytics goes wrong in known ways (shared/references/anchors_frameworks.md §4.7,
ecosystem_feasibility.md §3); this module handles each on purpose:

- **Start weights.** A ``YOLO(...).train()`` re-builds the model and re-initialises any layer whose name
  or shape differs. Here the trainer is handed the model built from the round's exact arrays before
  it starts (``trainer.model`` is an ``nn.Module``, so Ultralytics' ``setup_model`` keeps it), and a
  callback compares every tensor with the start arrays once training is set up: a mismatch aborts.
- **fp32 delta.** Ultralytics' ``best.pt``/``last.pt`` hold an fp16 copy; the update is taken from the
  in-memory fp32 EMA model instead (``trainer.ema.ema``), which is also what Ultralytics validates.
- **EMA.** Ultralytics averages weights with decay 0.9999·(1 − e^(−updates/2000)); its counter restarts
  every round, so over a round of a few hundred steps the EMA stays within a few percent of the raw
  weights, and it never carries state between rounds (the server's average is the cross-round memory).
- **BatchNorm.** Running means and variances are floating buffers: they travel in the delta and are
  averaged like weights (as seed 001's AVGForYOLO averages every layer); ``num_batches_tracked`` is an
  integer count and stays the server's.
- **Round schedule.** No warm-up (Ultralytics would ramp the learning rate up over ≥ 100 steps every
  round), a constant learning rate within the round (``lrf = 1``), SGD with the round's ``lr`` and
  ``momentum``, and ``nbs = batch`` so the optimizer steps every batch (Ultralytics otherwise
  accumulates to a nominal batch of 64: a small agent would make one step per epoch). With
  ``keep_momentum`` the optimizer's momentum continues from the agent's last round (``participant.momentum``).
- **Mixed precision** is the agent's choice (``[training] amp``, off by default): Ultralytics' own AMP
  switch would download a checkpoint for its check and start a new loss scale every round; ``participant.amp``
  runs fp16 with the scale kept across rounds instead. ``device`` may name a GPU (``cuda:1``).
- **Weight.** The update is weighted by the agent's annotated objects (seed 001), not images.
- **Partial aggregation** (``task.share`` = ``backbone`` or ``head``): the agent starts from the global
  shared part and its own kept private part (``<work_dir>/private-<share>.safetensors``; the global
  one in its first round), and reports no change on the private part, so only the shared part is
  averaged. Its local validation is of that personalized model.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import torch

from flcore.update import TrainResult
from models.serialization import load_file, save_file
from models.tasks import is_model_file
from models.training import collect_momentum, restore_momentum
from models.weights import NamedArrays, load_arrays, to_arrays
from models.yolo import prepare_run, shared_names
from models.yolo_dataset import class_counts, load_data_yaml
from models.yolo_eval import map_metrics
from models.zoo import build_model
from participant.amp import MixedPrecision, ScalerStore
from participant.declined import TrainingDeclined
from participant.momentum import MomentumStore
from participant.recipes import knobs_of, recipes_for
from participant.trainer import PeerContext
from protocol.messages import RoundTask

log = logging.getLogger("skyfed.agent")


class StartMismatch(RuntimeError):
    """Ultralytics would have trained from other weights than the round's."""


def private_part_path(work_dir: Path, share: str) -> Path:
    """Where an agent keeps the part of its model that ``share`` leaves local (kept across rounds)."""
    return work_dir / f"private-{share}.safetensors"


class DetectorTrainer:
    """Trains the round's YOLO model on ``data_yaml``'s train split, validates on its val split."""

    budget = None  # local DP-SGD is for classifiers (agent.config refuses it here)

    def __init__(self, data_yaml: Path, *, device: torch.device, agent_id: str, work_dir: Path, seed: int = 0,
                 amp: bool = False) -> None:  # fmt: skip
        self.data = load_data_yaml(data_yaml)
        self.objects = int(class_counts(self.data.train, self.data.num_classes).sum())  # > 0: agent.profile checks
        self.samples = len(self.data.train)
        self.device = device
        self.agent_id = agent_id
        self.seed = seed
        self.work_dir = work_dir
        self.yaml = prepare_run(self.data, work_dir, "data.yaml")
        self.momentum = MomentumStore(work_dir)
        self.amp = amp
        self.scaler = ScalerStore(work_dir)

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        if context is not None:
            raise TrainingDeclined("the detector trainer has no attention meta-network (FedAMN): classifiers only")
        from ultralytics.models.yolo.detect import DetectionTrainer

        model = build_model(task.model, num_classes=len(task.classes))
        private = set(global_arrays) - set(shared_names(list(global_arrays), model.yaml, task.share))
        start = {**global_arrays, **self._kept(task.share, global_arrays, private)}
        load_arrays(model, start)
        settings = task.train_of(self.agent_id)
        knobs = knobs_of(recipes_for(settings, "detector"))
        run = self.work_dir / "round"
        architecture = task.model if is_model_file(task.model) else f"{task.model}.yaml"  # what its logs name
        args = dict(model=architecture, data=str(self.yaml), epochs=settings.epochs, imgsz=settings.image_size,
                    batch=settings.batch_size, nbs=settings.batch_size, optimizer="SGD", lr0=settings.lr, lrf=1.0,
                    momentum=settings.momentum, warmup_epochs=0, close_mosaic=0, fraction=knobs.work,
                    device=str(self.device), workers=0, amp=False, plots=False,
                    val=bool(self.data.val), seed=self.seed * 100_003 + task.round, deterministic=False,
                    project=str(run.parent), name=run.name, exist_ok=True, verbose=False)  # fmt: skip
        trainer = DetectionTrainer(overrides=args)
        trainer.model = model
        kept_momentum = self.momentum.start(task, settings)
        trainer.add_callback("on_pretrain_routine_end", lambda t: check_start(t.model, start))
        trainer.add_callback("on_pretrain_routine_end", lambda t: restore_momentum(t.optimizer, t.model, kept_momentum))
        mixed = MixedPrecision(self.scaler, task.model)
        if self.amp:
            mixed.attach(trainer)
        trainer.train()
        mixed.finish(trainer, task.round)  # nothing when the round ran in fp32
        self.momentum.keep(task, settings, collect_momentum(trainer.optimizer, trainer.model))
        trained = trainer.ema.ema if trainer.ema is not None else trainer.model
        arrays = to_arrays(trained.float())
        if private:
            save_file(private_part_path(self.work_dir, task.share), {name: arrays[name] for name in sorted(private)})
            arrays = {**arrays, **{name: global_arrays[name] for name in private}}  # the private part: no change
        shutil.rmtree(run, ignore_errors=True)  # Ultralytics' own fp16 checkpoints of this round
        loss = float(sum(trainer.tloss.values())) if trainer.tloss else 0.0  # box + cls + dfl, mean of the last epoch
        return TrainResult(arrays=arrays, samples=self.samples, loss=loss, weight=self.objects,
                           local_eval=map_metrics(trainer.metrics or {}))  # fmt: skip

    def _kept(self, share: str, global_arrays: NamedArrays, private: set[str]) -> NamedArrays:
        """This agent's own private part for ``share`` when it kept one that fits the model, else nothing."""
        path = private_part_path(self.work_dir, share)
        if not private or not path.exists():
            return {}
        kept, _ = load_file(path)
        fits = set(kept) == private and all(kept[n].shape == global_arrays[n].shape for n in private)
        if not fits:
            log.warning("kept private part %s does not fit the model; starting it from the global one", path)
        return kept if fits else {}


def check_start(model: torch.nn.Module, start: NamedArrays) -> None:
    """Raise ``StartMismatch`` unless ``model`` holds exactly ``start`` (names, shapes and values)."""
    state = model.state_dict()
    if set(state) != set(start):
        raise StartMismatch("Ultralytics rebuilt the model: its tensor names differ from the round's")
    for name, tensor in state.items():
        if not np.array_equal(tensor.detach().cpu().numpy(), start[name]):
            raise StartMismatch(f"Ultralytics changed {name} before training; refusing to train from other weights")
