"""``python -m sim.agent_host --config A.toml --config B.toml …``: one or several agents in one OS process.

For simulations: each agent is exactly the daemon ``skyfed agent run`` starts — its own MQTT
connection and client id, keys, state folder and durable progress — running its loop on a thread of
its own, except that its training runs in this process (``agent.runner.InProcessRunner``) instead of
a training child: the hosted agents share one process and its PyTorch (about 370 MB of private
memory per process; ``skyfed sim --agents-per-process K``). Their jobs take turns on the process's cores
(``--jobs-at-once``, ``participant.jobs.OnSharedCores``; ``skyfed sim`` gives each host its share of the machine's,
``sim.launch.jobs_per_host``): 100 agents training at once on 2 cores each got a
hundredth of them and of the interpreter's lock, and a round took twice as long (docs/results/scale.md).
Experiments change an agent's trainer and nothing else:
``--attacker CONFIG`` hosts an agent whose trainer attacks, or that never sends (``sim.attacks``), ``--slow CONFIG`` one
whose training takes ``--slowdown`` times as long (``sim.slow``). SIGTERM stops every agent cleanly
(each publishes its final status); log lines carry the agent id as the thread name. Deployments run
one agent per process (``skyfed agent run``). Not part of the ``skyfed`` command on purpose.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from agent.config import load_agent_config
from agent.daemon import EdgeAgent
from agent.peer.node import PeerNode
from agent.runner import in_process_runner
from common.lock import hold_state_dir
from common.logs import configure_logging
from protocol.daemon import stop_on_signals
from sim.attacks import SCOPES, Attack, AttackingTrainer, SilentAgent
from sim.scale import hosted_tick_s
from sim.slow import SlowTrainer


def build_agents(args: argparse.Namespace) -> list[EdgeAgent | PeerNode]:
    """The hosted agents, attackers' and slow agents' trainers wrapped."""
    attack = Attack.parse(args.attack) if args.attacker else None
    slow = {Path(path).resolve() for path in args.slow}
    cores = threading.BoundedSemaphore(args.jobs_at_once) if args.jobs_at_once > 0 else None
    agents = []
    for path, attacking in [(p, False) for p in args.config] + [(p, True) for p in args.attacker]:
        config = load_agent_config(Path(path))
        hold_state_dir(config.state_dir, "agent.state_dir")  # one daemon per folder, as `skyfed agent run`
        silent = attacking and attack is not None and attack.kind == "silent"
        if config.peer_mode:  # a peer (agent.peer), trainer wrapped the same way
            agent = PeerNode(config, runner=in_process_runner(config, cores))
        else:
            agent = (SilentAgent if silent else EdgeAgent)(config, runner=in_process_runner(config, cores))
        if attacking and not silent:
            agent.runner.trainer = AttackingTrainer(agent.runner.trainer, attack, agent.id, args.scope)
        if Path(path).resolve() in slow:
            agent.runner.trainer = SlowTrainer(agent.runner.trainer, args.slowdown)
        agents.append(agent)
    for agent in agents:
        agent.edge.tick_interval_s = hosted_tick_s(len(agents))
    return agents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.agent_host", description=__doc__)
    parser.add_argument("--config", action="append", default=[], help="an agent.toml (repeatable)")
    parser.add_argument("--attacker", action="append", default=[], help="an agent.toml whose agent attacks")
    parser.add_argument("--attack", default="", help="sign-flip | scale:F | noise:SIGMA | samples:N | silent")
    parser.add_argument("--scope", default="parameters", choices=SCOPES)
    parser.add_argument("--slow", action="append", default=[], help="a hosted agent.toml whose agent is slow")
    parser.add_argument("--slowdown", type=float, default=1.0, help="how many times slower the slow agents train")
    parser.add_argument("--jobs-at-once", type=int, default=len(os.sched_getaffinity(0)),
                        help="how many hosted agents train (or export) at once, the others' jobs waiting their turn "
                             "(default: this process's cores; 0: no bound)")  # fmt: skip
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.jobs_at_once < 0:
        parser.error(f"--jobs-at-once must be 0 (no bound) or more, got {args.jobs_at_once}")
    configure_logging(args.log_level, thread_names=True)
    try:
        agents = build_agents(args)
    except (ValueError, OSError) as exc:  # a bad config (ConfigError is a ValueError) or an unreadable file
        print(f"sim.agent_host: cannot start: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    threads = [threading.Thread(target=agent.run, args=(stop,), name=agent.id) for agent in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
