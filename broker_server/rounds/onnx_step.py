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

from broker_server.rounds.pipeline import RoundContext, Step
from models.onnx_export import export_global
from models.weights import NamedArrays

log = logging.getLogger("skyfed.server")


@dataclass
class ExportOnnx(Step):
    model_name: str
    names: list[str]
    image_size: int
    path: Path
    name: str = "export-onnx"

    def run(self, ctx: RoundContext) -> None:
        if ctx.candidate is None or not ctx.plan.publish:
            return
        ctx.step_detail["onnx"] = self.export(ctx.candidate, f"round={ctx.state.round}")

    def export(self, arrays: NamedArrays, what: str) -> dict:
        """Export ``arrays`` (also the elected model at the end of a run); the report for metrics or status."""
        report = export_global(self.model_name, arrays, self.path, names=self.names, image_size=self.image_size)
        detail = {"ok": report.ok, "max_abs_diff": report.max_abs_diff, "seconds": round(report.seconds, 3)}
        if not report.ok:
            log.warning("onnx export failed %s reason=%s (the previous onnx file stays)", what, report.reason)
        return {**detail, **({"reason": report.reason} if report.reason else {})}
