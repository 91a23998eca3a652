"""Server-side evaluation of a candidate global model on the optional validation set (``server.eval_data``),
with the evaluators of ``models.evaluators`` (which a peer uses on its local validation split too)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.evaluators import ClassifierEvaluator, Evaluator, build_evaluator

if TYPE_CHECKING:
    from broker_server.config import ServerConfig

__all__ = ["ClassifierEvaluator", "Evaluator", "build_evaluator", "server_evaluator"]


def server_evaluator(config: ServerConfig) -> Evaluator | None:
    """The evaluator of ``server.eval_data``, or None when the server has no validation set."""
    if config.eval_path is None:
        return None
    server = config.server
    return build_evaluator(server.model, server.num_classes, config.eval_path,
                           image_size=config.training.image_size, work_dir=config.state_dir / "eval")  # fmt: skip
