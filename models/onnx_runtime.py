"""onnxruntime as SkyFed opens a model: on the CPU, and without telemetry.

Since 1.29 onnxruntime's Linux builds collect usage telemetry (a device id and an event cache under
``~/.cache/Microsoft``, uploaded to Microsoft) from the moment it is imported, unless
``ORT_DISABLE_TELEMETRY=1`` is set before that import; on a drone nothing may touch the network. Import
onnxruntime through this module, never directly, so the setting always comes first.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # read once, when onnxruntime starts

import onnxruntime  # noqa: E402 - after the setting above, on purpose

if hasattr(onnxruntime, "disable_telemetry_events"):  # the run-time switch too (it cannot undo the import's start)
    onnxruntime.disable_telemetry_events()


def cpu_session(path: Path, *, quiet: bool = False) -> onnxruntime.InferenceSession:
    """An inference session for the ONNX file at ``path`` on onnxruntime's CPU provider. ``quiet``: its worker
    threads sleep between runs, for a check of a few runs inside a busy daemon. By default they spin after each run,
    and on 2 cores shared with training that made a 3-run check of the digits CNN take 5-8 ms instead of 2-3
    (docs/results/scale.md)."""
    options = onnxruntime.SessionOptions()
    if quiet:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
