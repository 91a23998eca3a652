"""``skyfed server run`` with ``[upstream]``: a region's aggregator and its participant in the root's federation,
one process, two loops.

The aggregator (``broker_server.daemon.Aggregator``) runs on the main thread, on the region's broker, as any
server does; its rounds follow the root's (``broker_server.upstream.upstream_rounds``). The participant is an edge
agent (``agent.daemon.EdgeAgent``, a role in its edge node, ``agent.edge_node``: the session's will, status,
Prometheus come with it) named ``upstream.id`` in ``upstream.federation``, on ``[upstream.broker]``
(or on the region's own broker, bridged to the root's): it publishes status, receives the group key, the
signed round tasks and the root's model, and sends the region's aggregate up, sealed to the root, stored
durably and re-sent after a restart like any agent's update. Its trainer is the region
(``region.trainer.RegionalTrainer``). systemd hears from the aggregator's loop only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from agent.config import AgentConfig, AgentSection, KeysSection, TrainingSection
from agent.daemon import EdgeAgent
from agent.profile import DataProfile, StartFiles
from broker_server.config import ServerConfig
from broker_server.daemon import Aggregator
from broker_server.upstream.handoff import UpstreamHandoff
from common.sdnotify import Notifier
from models.tasks import task_of
from participant.jobs import InProcessRunner
from participant.recipes import checked_settings
from participant.trainer import Trainer
from protocol.config import ConfigError
from region.trainer import RegionalTrainer
from security.keys import Identity, PublicIdentity

log = logging.getLogger("skyfed.region")
JOIN_S = 5.0


def participant_config(config: ServerConfig) -> AgentConfig:
    """The region's participant in the root's federation, as an agent's config (its state in
    ``<state_dir>/upstream``)."""
    upstream = config.upstream
    assert upstream is not None
    return AgentConfig(
        path=config.path,
        agent=AgentSection(id=upstream.id, federation=upstream.federation, state_dir=str(config.state_dir / "upstream"),
                           data="", status_interval_s=config.server.status_interval_s),  # fmt: skip
        broker=upstream.broker or config.broker,
        keys=KeysSection(identity=upstream.identity, server=upstream.server),
        training=TrainingSection(onnx=False),  # the region's aggregator exports the model it holds
    )


def participant_files(config: ServerConfig, agent: AgentConfig) -> StartFiles:
    """The participant's keys (checked: its key must be ``upstream.id``'s) and what it can train: the region's model."""
    where = f"{config.path}: "
    try:
        identity_path, root_path = config.upstream_keys
        identity, root = Identity.load(identity_path), PublicIdentity.load(root_path)
    except ValueError as exc:
        raise ConfigError(f"{where}[upstream]: {exc}") from None
    if identity.name != agent.agent.id:
        raise ConfigError(f"{where}upstream.identity holds the key of {identity.name!r}, not upstream.id "
                          f"{agent.agent.id!r}: give the region's own key, the one enrolled at the root")  # fmt: skip
    profile = DataProfile(task_of(config.server.model), samples=0, names=tuple(config.server.classes))
    return StartFiles(identity, root, profile)


class Region:
    """Both loops; a stop (signal) ends both, and the participant's wait for a regional round with them."""

    def __init__(self, config: ServerConfig, wrap: Callable[[Trainer], Trainer] | None = None) -> None:
        """``wrap`` stands between the region's trainer and its participant (``sim.rogue_region``'s lie)."""
        self.handoff = UpstreamHandoff()
        agent_config = participant_config(config)
        files = participant_files(config, agent_config)
        self.aggregator = Aggregator(config, upstream=self.handoff)
        own = self.aggregator.engine.strategy.configure_train(config.training, 1, {}).shared  # its agents' recipes
        trainer: Trainer = RegionalTrainer(self.handoff, agent_config.agent.id, checked_settings(own).recipes)
        runner = InProcessRunner(trainer if wrap is None else wrap(trainer))
        self.participant = EdgeAgent(agent_config, runner=runner, files=files)
        self.participant.edge.notifier = Notifier({})  # one service, one voice: the aggregator's

    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        thread = threading.Thread(target=self.participant.run, args=(stop,), name="upstream", daemon=True)
        thread.start()
        try:
            self.aggregator.run(stop)
        finally:
            stop.set()
            self.handoff.close()
            thread.join(JOIN_S)
