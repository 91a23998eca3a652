"""Run a whole federation locally: a broker, the aggregator and N agents as separate processes.

The processes are the real daemons (``skyfed server run``, ``skyfed agent run``) on the generated
configs, talking over a real MQTT broker; this module only starts them, prints one line per round
from the public ``server/metrics`` topic, and collects the results into ``--out``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from protocol.messages import MessageError, RoundMetrics
from protocol.mqtt import BrokerSettings, MqttClient, parse_address
from protocol.topics import Topics
from sim.federation import SimSettings, create_federation
from sim.launch import (
    SimResult,
    collect_results,
    format_round,
    fresh_run_folder,
    logged_rounds,
    run_broker,
    spawn,
    spawn_agents,
    terminate,
)
from sim.nats_cluster import parse_cluster_spec, start_nats_cluster
from sim.progress import BarProgress, LineProgress, feed


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so a killed sim still stops the broker and processes it started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def broker_nodes(stack: ExitStack, work: Path, broker_address: str | None, cluster: str | None, echo) -> list[str]:  # noqa: ANN001
    """The run's broker nodes (HOST:PORT): a NATS cluster started for it (``cluster``: ``nats:N``), the nodes of a
    given ``broker_address`` (a cluster's comma-separated), or ``run_broker``'s one."""
    if cluster is not None:
        nats = stack.enter_context(start_nats_cluster(work / "nats", parse_cluster_spec(cluster)))
        echo(f"broker: NATS cluster of {len(nats.nodes)} nodes, MQTT on {nats.address} (started for this run)")
        return nats.addresses
    if broker_address is not None and "," in broker_address:
        given = BrokerSettings.from_address(broker_address)
        echo(f"broker: {given.address_list} (given: a cluster's nodes)")
        return given.address_list.split(",")
    host, port = run_broker(stack, work, broker_address, echo)
    return [f"{host}:{port}"]


def run_sim(
    settings: SimSettings,
    out: Path,
    *,
    broker_address: str | None = None,
    broker_cluster: str | None = None,
    echo=print,  # noqa: ANN001
    progress: LineProgress | BarProgress | None = None,
) -> SimResult:
    """Run the federation to completion and leave metrics.jsonl, curves.png and the model in ``out``; with
    ``progress``, show the agents' training as it goes (client mode over MQTT)."""
    if settings.in_process:
        from sim.inprocess import run_in_process  # loaded only for its kind of run

        return run_in_process(settings, out, echo=echo)
    if settings.regions:
        from sim.region_run import run_region_sim  # loaded only for its kind of run

        return run_region_sim(settings, out, echo=echo)
    if settings.mode == "peer":
        from sim.peer_run import run_peer_sim  # loaded only for its kind of run

        return run_peer_sim(settings, out, broker_address=broker_address, echo=echo)
    out, work = fresh_run_folder(out)
    started = time.monotonic()
    with ExitStack() as stack:
        nodes = broker_nodes(stack, work, broker_address, broker_cluster, echo)
        layout = create_federation(work, settings, parse_address(nodes[0]), cluster=nodes)
        for line in layout.description:
            echo(f"  {line}")
        topics = Topics(settings.federation)
        broker = BrokerSettings.from_address(",".join(nodes))
        watcher = MqttClient(f"sim-{uuid.uuid4().hex[:8]}", broker, persistent=False)
        watcher.subscribe(topics.server_metrics)
        if progress is not None:
            watcher.subscribe(topics.agent_status("+"))
            stack.callback(progress.close)
        if not watcher.start(timeout_s=10):
            raise RuntimeError(f"cannot connect to the broker at {broker.address_list}: {watcher.problem}")
        stack.callback(watcher.stop)
        logs = work / "logs"
        logs.mkdir()
        server = spawn(["server", "run", "--config", str(layout.server_config)], logs / "server.log")
        attackers = settings.attacker_names()
        if attackers:
            echo(f"  attackers ({settings.attack}, {settings.attack_scope}): {', '.join(attackers)}")
        if settings.slow_agents:
            echo(f"  slow agents ({settings.slowdown:g}x): {', '.join(settings.slow_names())}")
        agents = spawn_agents(layout.agent_configs, settings, logs)
        stack.callback(terminate, [server, *agents])
        deadline = time.monotonic() + settings.rounds * (settings.deadline_s * 3) + 120
        shown = follow_rounds(watcher, server, deadline, lambda m: echo(format_round(m, time.monotonic() - started)),
                              lambda topic, payload: progress is not None and feed(progress, topics, topic, payload))
        if server.poll() is None or server.returncode != 0:
            tail = (logs / "server.log").read_text()[-3000:]
            raise RuntimeError(f"the server did not finish cleanly (logs in {logs}):\n{tail}")
    state = work / "server" / "state"
    metrics = logged_rounds(state / "metrics.jsonl")
    wall_started = time.time() - (time.monotonic() - started)
    for m in metrics:  # the last rounds' messages may still be on their way when the server exits
        if m.round not in shown:
            echo(format_round(m, m.finished_at - wall_started))
    extra = {"attackers": attackers, "attack": settings.attack or None, "slow_agents": settings.slow_names(),
             "availability": settings.availability or None,
             "async": {"mode": "async", **settings.async_table()} if settings.asynchronous else None,
             "run_started_at": round(wall_started, 3)}  # a round's finished_at minus it: the time into the run
    return collect_results(state, out, extra, metrics, started)


def follow_rounds(watcher: MqttClient, server: subprocess.Popen, deadline: float,
                  show: Callable[[RoundMetrics], None],
                  other: Callable[[str, bytes], bool] = lambda _topic, _payload: False) -> set[int]:  # fmt: skip
    """Show each round's metrics from the public topic as it comes, while the server runs; returns the rounds
    shown. Only for the live lines: a message published just before the server exits can arrive after it did
    (a loaded machine missed the last round's), so the server's ``metrics.jsonl`` is the record. Messages
    ``other`` takes (an agent's status, for the progress display) are not metrics."""
    shown: set[int] = set()
    while server.poll() is None and time.monotonic() < deadline:
        message = watcher.poll(0.2)
        if message is None or other(*message):
            continue
        try:
            m = RoundMetrics.from_json(message[1])
        except MessageError:
            continue
        shown.add(m.round)
        show(m)
    return shown
