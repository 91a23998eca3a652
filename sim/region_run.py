"""``skyfed sim --regions R``: a root broker and server, R regional mosquittos each bridged to the root's
(``provisioning.bridge``), R regional aggregators (``skyfed server run`` with ``[upstream]``) and the agents,
split between the regions, all as separate processes over real brokers.

The root's ``metrics.jsonl`` lists the regions as its participants (``region-1`` …) and goes to ``--out`` as
a flat run's does; each region's own metrics go beside it, in ``--out/regions/region-<k>/metrics.jsonl``.
"""

from __future__ import annotations

import shutil
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from protocol.messages import MessageError, RoundMetrics
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import Topics
from provisioning.bridge import bridge_conf_text
from sim.broker import start_broker
from sim.federation import SimSettings
from sim.launch import SimResult, collect_results, format_round, fresh_run_folder, spawn, spawn_agents, terminate
from sim.regions import create_regions, region_names


def run_region_sim(settings: SimSettings, out: Path, *, echo=print) -> SimResult:  # noqa: ANN001
    out, work = fresh_run_folder(out)
    started = time.monotonic()
    with ExitStack() as stack:
        root = stack.enter_context(start_broker(data_dir=work / "broker", kind="mosquitto"))
        echo(f"root broker: mosquitto on {root.address} (started for this run)")
        brokers = []
        for region in region_names(settings.regions):
            bridge = bridge_conf_text(settings.federation, region, root.address)
            brokers.append(stack.enter_context(start_broker(data_dir=work / f"broker-{region}", kind="mosquitto",
                                                            extra_config=bridge)))  # fmt: skip
            echo(f"{region} broker: mosquitto on {brokers[-1].address}, bridged to the root's")
        layout = create_regions(work, settings, (root.host, root.port), [(b.host, b.port) for b in brokers])
        for region, agents in layout.members.items():
            echo(f"  {region}: {len(agents)} agents ({agents[0]} … {agents[-1]})" if len(agents) > 4
                 else f"  {region}: {', '.join(agents)}")  # fmt: skip
        for line in layout.flat.description:
            echo(f"  {line}")
        watcher = MqttClient(f"sim-{uuid.uuid4().hex[:8]}", BrokerSettings(host=root.host, port=root.port),
                             persistent=False)  # fmt: skip
        watcher.subscribe(Topics(settings.federation).server_metrics)
        if not watcher.start(timeout_s=10):
            raise RuntimeError(f"cannot connect to the root broker at {root.address}")
        stack.callback(watcher.stop)
        logs = work / "logs"
        logs.mkdir()
        server = spawn(["server", "run", "--config", str(layout.flat.server_config)], logs / "server.log")
        rogue = region_names(settings.regions)[: settings.attack_regions]
        regional = [spawn(["--config", str(path), "--attack", settings.attack, "--attack-scope", settings.attack_scope],
                          logs / f"{region}.log", module="sim.rogue_region") if region in rogue
                    else spawn(["server", "run", "--config", str(path)], logs / f"{region}.log")
                    for region, path in layout.regions.items()]  # fmt: skip
        agents = spawn_agents(layout.flat.agent_configs, settings, logs)
        stack.callback(terminate, [server, *regional, *agents])
        metrics: list[RoundMetrics] = []
        deadline = time.monotonic() + settings.rounds * (settings.deadline_s * 6) + 180
        while server.poll() is None and time.monotonic() < deadline:
            message = watcher.poll(0.2)
            if message is None:
                continue
            try:
                metrics.append(RoundMetrics.from_json(message[1]))
            except MessageError:
                continue
            echo(format_round(metrics[-1], time.monotonic() - started))
        if server.poll() is None or server.returncode != 0:
            tail = (logs / "server.log").read_text()[-3000:]
            raise RuntimeError(f"the root server did not finish cleanly (logs in {logs}):\n{tail}")
    for region, path in layout.regions.items():
        target = out / "regions" / region
        target.mkdir(parents=True, exist_ok=True)
        if (source := path.parent / "state" / "metrics.jsonl").exists():
            shutil.copy(source, target / "metrics.jsonl")
    extra = {"regions": layout.members, "availability": settings.availability or None}
    return collect_results(work / "server" / "state", out, extra, metrics, started)
