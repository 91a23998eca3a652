"""FedAMN's attention meta-network (seed 003; ``participant.meta_attention``): before the base network trains, the
meta-network is trained on the participant's own data over its cluster mates' models and the global model, and
its output becomes the start model. Without cluster mates (``LocalRun.context`` None: before FedAMN's clusters
exist) it does nothing. Local DP-SGD does not cover it: the meta-network trains on the same data un-noised."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from participant.declined import TrainingDeclined
from participant.recipes.base import LocalRun, Recipe

STATE_FILE = "meta_attention.safetensors"  # Θ, kept across rounds
log = logging.getLogger("skyfed.agent")


@dataclass(frozen=True)
class AttentionOptions:
    epochs: int = 1  # the meta-network's passes over the participant's data each round (0: not trained)
    lr: float = 0.01  # its Adam learning rate

    def __post_init__(self) -> None:
        if self.epochs < 0 or not self.lr > 0:
            raise ValueError(f"epochs must be >= 0 and lr > 0, got {self.epochs} and {self.lr}")


class MetaAttention(Recipe):
    name = "attention"
    Options = AttentionOptions

    def before(self, run: LocalRun) -> None:
        if run.context is None:
            return
        if run.private:
            raise TrainingDeclined("local DP-SGD does not cover FedAMN's attention meta-network, which also trains on "
                                   "this agent's data: run fedamn without [privacy] local DP")  # fmt: skip
        from models.weights import load_arrays
        from participant.meta_attention import attention_start

        started = time.perf_counter()
        arrays, report = attention_start(run.model, run.start, run.context.peers, run.context.global_model, run.data,
                                         epochs=self.options.epochs, lr=self.options.lr,
                                         batch_size=run.settings.batch_size, seed=run.seed, device=run.device,
                                         state_path=run.state_dir / STATE_FILE)  # fmt: skip
        load_arrays(run.model, arrays)
        log.info("attention round=%d peers=%d top_peer_weight=%.3f global_weight=%.3f meta_loss=%.4f seconds=%.2f",
                 run.round, len(report.peer_weights), max(report.peer_weights), report.global_weight, report.loss,
                 time.perf_counter() - started)  # fmt: skip
