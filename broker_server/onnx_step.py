"""The round step that offers each new global model as ONNX for on-board inference (``agent infer``).

Runs last, on the model about to be published: ``models.onnx_export`` writes ``global_model.onnx`` in the
server's state dir only after onnxruntime reproduced PyTorch on sample inputs. A failed export is
logged and reported in ``metrics.aggregation.onnx``; it never rolls the round back (the model itself is
fine) and never replaces the previous good file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from broker_server.pipeline import RoundContext, Step
from models.onnx_export import export_global

log = logging.getLogger("skyfed.server")


@dataclass
class ExportOnnx(Step):
    model_name: str
    names: list[str]
    image_size: int
    path: Path
    name: str = "export-onnx"

    def run(self, ctx: RoundContext) -> None:
        if ctx.candidate is None or ctx.state.action != "average":
            return
        report = export_global(self.model_name, ctx.candidate, self.path, names=self.names,
                               image_size=self.image_size)  # fmt: skip
        detail = {"ok": report.ok, "max_abs_diff": report.max_abs_diff, "seconds": round(report.seconds, 3)}
        ctx.step_detail["onnx"] = {**detail, **({"reason": report.reason} if report.reason else {})}
        if not report.ok:
            log.warning("onnx export failed round=%d reason=%s (the previous onnx file stays)", ctx.state.round,
                        report.reason)  # fmt: skip
