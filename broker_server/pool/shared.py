"""The server's shared data pool (seed 002, FLStudio's hybrid data sharing): ``[pool] data`` trained as one
more participant, ``server-pool``, every round.

The pool trains with the agents' own trainer (``participant.classifier.ClassifierTrainer``) on a thread
(``participant.jobs.InProcessRunner``) through the participant's round work (``participant.round_client``), so
the daemon's loop never waits for it: the job starts when the round is announced, from the round's global model
and settings, and its update, encoded and stored as an agent's (``flcore.update.encode_update``), goes through
``RoundEngine.accept`` like an agent's (the same structural checks, norm limit and invariants), then the round's
influence bounds and differential privacy's clip, noise and accounting. The engine selects the pool beside the
round's agents and waits for it as for them: its update arrives by the deadline, or it is missed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from broker_server.config import ServerConfig
from broker_server.pool import POOL
from models.datasets import load_dataset
from models.weights import NamedArrays
from participant.classifier import ClassifierTrainer
from participant.jobs import InProcessRunner, Trained
from participant.progress import ProgressStore
from participant.round_client import RoundClient
from protocol.config import ConfigError
from protocol.messages import AgentStart, RoundTask
from protocol.transfer import Completed
from security.envelope import NO_DIGEST, Manifest

log = logging.getLogger("skyfed.server")


def local_update(task: RoundTask, sender: str, data: bytes, wire_bytes: int) -> Completed:
    """An update that did not travel over MQTT (the pool's; the in-process sim's agents') as the reassembler
    would hand it over, unsealed: ``wire_bytes`` is what it counts in ``bytes_up``."""
    manifest = Manifest(task.federation, "update", task.round, sender, "server", bytes(16), time.time(),
                        len(data), len(data), 1, NO_DIGEST)  # fmt: skip
    return Completed(manifest, memoryview(data), wire_bytes)


@dataclass(frozen=True)
class PoolResult:
    """The pool's finished job for ``round``: its update, or why there is none (its training failed)."""

    round: int
    update: Completed | None
    reason: str = ""


class SharedPool:
    """The pool participant: one training job at a time, started per round, polled by the daemon's loop."""

    def __init__(self, config: ServerConfig, device: object = None) -> None:
        from models.zoo import input_shape, pick_device

        path = config.pool_path
        assert path is not None
        data = load_dataset(path)
        if data.x.shape[1:] != input_shape(config.server.model):
            raise ConfigError(f"{config.path}: pool.data holds samples of shape {data.x.shape[1:]}, server.model "
                              f"{config.server.model} takes {input_shape(config.server.model)}")  # fmt: skip
        self.samples = len(data)
        self.work_dir = config.state_dir / "pool"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        trainer = ClassifierTrainer(data, device=device or pick_device(), agent_id=POOL, work_dir=self.work_dir,
                                    seed=config.server.seed)  # fmt: skip
        self.client = RoundClient(POOL, InProcessRunner(trainer), ProgressStore(self.work_dir), log=log)

    @property
    def round(self) -> int | None:
        """The round the pool is training for, if it is."""
        training = self.client.training
        return None if training is None else training.task.round

    def start(self, task: RoundTask, base: NamedArrays) -> None:
        """Train ``task`` from ``base`` (the round's global model), unless the pool already trains this round."""
        training = self.client.training
        if training is not None and (training.task.run_id, training.task.round) == (task.run_id, task.round):
            return
        self.cancel("a new round opened")
        base = {name: array.copy() for name, array in base.items()}  # the engine may move on while it trains
        self.client.train(task, AgentStart(POOL, "global", task.model_sha256), base)
        log.info("pool training started round=%d samples=%d optimizer=%s", task.round, self.samples,
                 task.train_of(POOL).optimizer)  # fmt: skip

    def cancel(self, reason: str) -> None:
        """Drop the running job (its round closed, or another one opened)."""
        if (round_number := self.round) is not None:
            self.client.poll(cancel=reason, refuse=reason)  # an in-process job ends at once; a result is dropped
            log.info("pool training dropped round=%d reason=%s", round_number, reason)

    def poll(self) -> PoolResult | None:
        """The finished job's update, encoded as an agent encodes one, or why there is none; None while it runs."""
        report = None if self.client.training is None else self.client.poll()
        if report is None:
            return None
        task, outcome = report.task, report.outcome
        if not isinstance(outcome, Trained) or report.update is None:
            reason = getattr(outcome, "reason", type(outcome).__name__)
            log.warning("pool training failed round=%d reason=%s", task.round, reason)
            return PoolResult(task.round, None, reason)
        return PoolResult(task.round, local_update(task, POOL, report.update, wire_bytes=0))  # it never left the server

    def wait(self, poll_s: float = 0.01) -> PoolResult | None:
        """Block until the job ends (the in-process sim, which has no loop to poll from); None without one."""
        while self.client.training is not None:
            if (result := self.poll()) is not None:
                return result
            time.sleep(poll_s)
        return None
