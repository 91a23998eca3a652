"""``python -m agent.training_child --config agent.toml``: the agent's training child (``agent.runner``).

Reads one JSON request per line on stdin (``{"kind": "train" | "export", "dir": …, "task": {…},
"path": …}``: the start model is ``<dir>/base.safetensors``, FedAMN's other models
``<dir>/context.safetensors``; ``path``, where to export it to ONNX),
does it with PyTorch, and answers one JSON line: ``{"ok": true, "export": {…}}`` (a train job's result
is in ``<dir>/result.safetensors``), ``{"exported": detail}``, ``{"declined": reason}`` or
``{"failed": reason}`` (``agent.runner.as_reply``).
With ``--prepare`` (a child started ahead of its job: as the agent joins, or as a round is announced) it builds
the trainer at once: PyTorch's import and the data's load overlap the server's start or the model's download.
Exits when stdin closes. Only replies go to stdout: the file descriptor is moved aside at start and stdout
points at stderr, so whatever a library prints ends up in the agent's log, not in the protocol.
The request comes from the agent's own daemon, which checked and signed-off the task; it is trusted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from agent.config import load_agent_config
from agent.runner import CONTEXT_FILE, as_reply, in_process_runner, write_result
from common.logs import configure_logging
from models.own import model_refusal
from models.serialization import load_file
from models.yolo import ultralytics_offline
from participant.jobs import Declined, Trained, export_onnx, run_guarded, train_and_export
from participant.trainer import PeerContext, Trainer
from protocol.messages import RoundTask


def reply_channel() -> object:
    """The real stdout for replies; fd 1 (``print``, progress bars) now goes to stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return replies


class Worker:
    def __init__(self, config_path: Path, *, prepare: bool = False) -> None:
        self.config = load_agent_config(config_path)
        # before any job imports Ultralytics (an export may come first): its settings under the state dir
        ultralytics_offline(self.config.detector_dir / "ultralytics")
        self.trainer: Trainer | None = None  # built at the first train job: loading data and PyTorch is its cost
        if prepare:
            self.trainer = in_process_runner(self.config).trainer

    def perform(self, request: dict) -> dict:
        directory = Path(request["dir"])
        task = RoundTask.from_dict(request["task"])
        if refusal := model_refusal(task.model, self.config.own_model):  # never import a name the task brought
            return as_reply(Declined(refusal))
        arrays, _ = load_file(directory / "base.safetensors")
        export_to = Path(request["path"]) if "path" in request else None
        if request["kind"] == "export" and export_to is not None:
            return as_reply(run_guarded(lambda: export_onnx(arrays, task, export_to)))
        if self.trainer is None:
            self.trainer = in_process_runner(self.config).trainer
        context = PeerContext.from_arrays(load_file(path)[0]) if (path := directory / CONTEXT_FILE).exists() else None
        outcome = train_and_export(self.trainer, arrays, task, export_to, context)
        if isinstance(outcome, Trained):
            write_result(directory, outcome.result)
        return as_reply(outcome)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.training_child", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--prepare", action="store_true", help="build the trainer now, before the first request")
    parser.add_argument("--log-level", default=os.environ.get("SKYFED_LOG_LEVEL", "info"))
    args = parser.parse_args(argv)
    replies = reply_channel()
    threading.current_thread().name = "training-child"  # its log lines, in the agent's journal, say so
    configure_logging(args.log_level, thread_names=True)
    worker = Worker(Path(args.config), prepare=args.prepare)
    for line in sys.stdin:
        try:
            reply = worker.perform(json.loads(line))
        except (OSError, ValueError, KeyError) as exc:  # a request the daemon should never have sent
            reply = {"failed": f"bad request: {exc}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
