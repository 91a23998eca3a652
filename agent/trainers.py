"""The trainer ``agent.toml`` names (``training.trainer``), built from the agent's config: the edge side of
``participant.trainer``'s plug-in point."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from models.datasets import Dataset, load_dataset
from participant.local_dp import budget_for
from participant.trainer import Trainer

if TYPE_CHECKING:
    import torch

    from agent.config import AgentConfig


def build_trainer(config: AgentConfig, device: torch.device) -> Trainer:
    """The trainer ``training.trainer`` names, with its data loaded (imports PyTorch: call it where training runs)."""
    if config.training.trainer == "detector":
        from participant.detector import DetectorTrainer

        return DetectorTrainer(config.data_path, device=device, agent_id=config.agent.id, work_dir=config.detector_dir,
                               seed=config.agent.seed, amp=config.training.amp)  # fmt: skip
    from participant.classifier import ClassifierTrainer

    data = classifier_data(config, config.data_path)
    budget = budget_for(config.privacy, config.state_dir, len(data))
    test = classifier_data(config, path) if (path := config.test_data_path) is not None else None
    return ClassifierTrainer(data, device=device, agent_id=config.agent.id, work_dir=config.state_dir,
                             seed=config.agent.seed, budget=budget, test_data=test, model=config.own_model)  # fmt: skip


def classifier_data(config: AgentConfig, path: Path) -> Dataset:
    """``agent.data`` or ``agent.test_data`` (``path``), read by ``agent.data_loader`` when set, else as an .npz."""
    if config.agent.data_loader:
        from models.own import load_own_data

        return load_own_data(config.agent.data_loader, path, "agent.data_loader")
    return load_dataset(path)
