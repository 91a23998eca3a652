"""``skyfed sim --in-process``: a federation of many agents in one process, for scales one machine's
daemons cannot hold (1,000 agents: at 25 agents per process, 100 agents took 2.1 GB, so 1,000 would
need about 21 GB of this machine's 23 GB, on two cores).

What runs is the real code on both sides: the round engine (selection, the update checks of
``accept``, the bounds, the strategy, differential privacy's noise, adaptive clip and accountant,
checkpoints, ``metrics.jsonl``) and each agent's trainer (``ClassifierTrainer``, with Opacus when the
agents have local DP) and update encoding (the round's codec, with error feedback kept in each agent's
state folder). Attackers' trainers are wrapped as ``sim.agent_host`` wraps them
(``sim.attacks``). What is left out is the transport: no broker, no daemons, no sealing; an update goes
from the trainer to ``RoundEngine.accept`` as the plaintext the server would have opened, and every
selected agent delivers (no deadlines, no stragglers), then the server's shared pool if it has one
(``[pool]``, ``broker_server.pool.shared``); a refused update is listed in the round's ``rejected``, as the
daemon lists it. ``bytes_down`` counts the models' plaintext (the
daemons' counts add the sealing's few bytes per chunk). The output is ``skyfed sim``'s:
``metrics.jsonl``, ``curves.png`` and ``global_model.safetensors`` in ``--out``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from agent.config import load_agent_config
from agent.device import torch_device
from agent.trainers import build_trainer
from broker_server.agents.publisher import PublishedModel
from broker_server.config import load_server_config
from broker_server.pool import POOL
from broker_server.pool.shared import SharedPool, local_update
from broker_server.rounds.engine import RoundEngine
from broker_server.rounds.evaluation import server_evaluator
from broker_server.rounds.round_task import round_task
from flcore.update import UpdateRejected, encode_update
from models.serialization import dumps
from models.weights import NamedArrays, float_part
from participant.local_dp import PrivacyBudget
from participant.progress import RESIDUAL_FILE
from participant.trainer import PeerContext, Trainer
from protocol.messages import RoundTask
from protocol.transfer import Completed
from security.replay import ReplayGuard
from sim.attacks import Attack, AttackingTrainer
from sim.federation import SimSettings, create_federation
from sim.launch import SimResult, collect_results, format_round


@dataclass
class InProcessAgent:
    name: str
    trainer: Trainer
    budget: PrivacyBudget | None
    residual: Path  # the codec's error feedback (protocol.codecs), in the agent's state folder
    silent: bool = False  # ``--attack silent``: trains, never delivers
    continued: tuple[str, NamedArrays] | None = None  # after local rounds: (the start it trained on from, its model)


def _agents(configs: dict[str, Path], settings: SimSettings) -> list[InProcessAgent]:
    attackers = settings.attacker_names()
    attack = Attack.parse(settings.attack) if settings.attack else None
    agents = []
    for name, path in configs.items():
        config = load_agent_config(path)
        trainer = build_trainer(config, torch_device(config.training.device))  # where the agent would train
        silent = name in attackers and attack is not None and attack.kind == "silent"
        if name in attackers and not silent:
            trainer = AttackingTrainer(trainer, attack, name, settings.attack_scope)
        agents.append(InProcessAgent(name, trainer, trainer.budget, config.state_dir / RESIDUAL_FILE, silent))
    return agents


def _deliver(engine: RoundEngine, agent: InProcessAgent, task: RoundTask) -> None:
    """``agent`` trains from its start model (and FedAMN's other models) and its update, in the round's
    codec, goes through the server's acceptance."""
    base, start, bundle = engine.start_model(agent.name), task.start_of(agent.name), engine.peer_bundle(agent.name)
    context = None if bundle is None else PeerContext(bundle, float_part(engine.global_arrays))
    rs = engine.round_state
    assert rs is not None
    rs.inbox_bytes += (len(dumps(base)) if start.source == "inbox" else 0) + (len(dumps(bundle)) if bundle else 0)
    held = agent.continued
    train_from = held[1] if held is not None and start.continues and held[0] == start.sha256 else base
    result = agent.trainer.train(train_from, task, context)
    if task.action == "local":  # trained on, kept here, nothing uploaded (``broker_server.rounds.local_rounds``)
        agent.continued = (start.sha256, result.arrays)
        engine.local.trained_locally([agent.name])
        return
    local_delta = agent.budget.policy.delta if agent.budget is not None else None
    base_sha256 = "" if start.source == "global" else start.sha256
    data, _ = encode_update(task, base, result, residual=agent.residual, base_sha256=base_sha256,
                            local_delta=local_delta)  # fmt: skip
    _accept(engine, local_update(task, agent.name, data, wire_bytes=len(data)))


def _accept(engine: RoundEngine, update: Completed) -> None:
    """The update into the round; a refusal is recorded in the round's metrics, as the daemon records it."""
    try:
        engine.accept(update)
    except UpdateRejected as exc:
        engine.reject(update.manifest.sender, exc.reason)


def _deliver_pool(engine: RoundEngine, pool: SharedPool, task: RoundTask) -> None:
    """The shared pool trains (on its thread, waited for here) and its update goes through the acceptance."""
    pool.start(task, engine.global_arrays)
    result = pool.wait()
    if result is None or result.update is None:
        why = f"its training failed: {result.reason if result else 'no job'}"
        engine.fleet.gave_up(POOL, task.round, why, time.time())
        return
    _accept(engine, result.update)


def run_in_process(settings: SimSettings, out: Path, *, echo: Callable[[str], None] = print) -> SimResult:
    """Run ``settings`` to completion in this process; the same files in ``out`` as ``run_sim``."""
    out.mkdir(parents=True, exist_ok=True)
    work = out / "federation"
    shutil.rmtree(work, ignore_errors=True)
    started = time.monotonic()
    torch.set_num_threads(1)  # one small model at a time: threads cost more than they give
    layout = create_federation(work, settings, ("127.0.0.1", 1))  # the broker address is never used
    config = load_server_config(layout.server_config)
    engine = RoundEngine(config, replay=ReplayGuard(3600), evaluator=server_evaluator(config))
    agents = {a.name: a for a in _agents(layout.agent_configs, settings)}
    pool = SharedPool(config) if config.pool.enabled else None
    echo(f"in process: {len(agents)} agents, the round engine and their trainers (no broker, no daemons)")
    metrics = []
    while not engine.finished:
        volunteers = [a.name for a in agents.values() if a.budget is None or not a.budget.refusal(None, a.name)]
        rs = engine.begin_round(volunteers, time.time(), enrolled=list(agents))
        if rs is None:
            if not engine.finished:
                echo(f"stopping: {len(volunteers)} agents volunteer, rounds.min_agents is {engine.rules.min_agents}")
            break
        engine.announce(time.time())
        global_model = PublishedModel(engine.version, f"{engine.version:064x}", 1, 0)  # no broker: a stand-in digest
        task = round_task(engine, global_model, federation=settings.federation, group_key_id="", now=time.time())
        for name in rs.selected:
            if name == POOL:
                continue
            agent = agents[name]
            if not agent.silent and (agent.budget is None or not agent.budget.refusal(task, name)):
                _deliver(engine, agent, task)
        if pool is not None and POOL in rs.selected:
            _deliver_pool(engine, pool, task)
        metrics.append(engine.close(time.time(), model_wire_bytes=len(dumps(engine.global_arrays))))
        echo(format_round(metrics[-1], time.monotonic() - started))
    extra = {"in_process": True, "attackers": settings.attacker_names(), "attack": settings.attack or None}
    return collect_results(config.state_dir, out, extra, metrics, started)
