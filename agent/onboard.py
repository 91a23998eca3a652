"""The agent's copy of the newest global model as ONNX, for its on-board detector (``skyfed agent infer``).

Each new global model version the agent holds is exported once to ``<state_dir>/global_model.onnx``
(``models.onnx_export``: written only after onnxruntime reproduced PyTorch; a failed export keeps the
previous file and is logged). The export needs the round task (model name, classes, image size), so
it runs once both the task and its model version are here, whichever came last.
"""

from __future__ import annotations

import logging
from pathlib import Path

from models.onnx_export import export_global
from models.weights import NamedArrays
from protocol.messages import RoundTask

log = logging.getLogger("skyfed.agent")


class OnboardModel:
    def __init__(self, state_dir: Path, enabled: bool = True) -> None:
        self.path = state_dir / "global_model.onnx"
        self.enabled = enabled
        self.version = 0  # the newest version exported (or tried)

    def update(self, task: RoundTask | None, models: dict[int, NamedArrays]) -> None:
        """Export the task's global model version if this agent holds it and has not exported it yet."""
        if not self.enabled or task is None or task.model_version <= self.version or task.model_version not in models:
            return
        if task.share != "full":  # the global model is only part of this agent's model; not exported (yet)
            return
        self.version = task.model_version
        names = task.classes or [str(i) for i in range(task.num_classes)]
        report = export_global(task.model, models[task.model_version], self.path, names=names,
                               image_size=task.train.image_size)  # fmt: skip
        if report.ok:
            log.info("onnx model kept version=%d path=%s max_abs_diff=%.2g seconds=%.2f", self.version, self.path,
                     report.max_abs_diff, report.seconds)  # fmt: skip
        else:
            log.warning(
                "onnx export failed version=%d reason=%s (the previous file stays)", self.version, report.reason
            )
