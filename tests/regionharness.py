"""Test helpers: a federation of regions in one process, over real bridged brokers.

A root mosquitto, one mosquitto per region bridged to it (``provisioning.bridge``), the root's aggregator, each
region's daemon (``region.daemon.Region``: its aggregator and its participant at the root) and every agent
(``fedharness.hosted_agent``) on threads of the test, on the layout ``skyfed sim --regions`` writes
(``sim.regions``). Tests reach each part: restart a region's broker, swap an agent's trainer, read metrics.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from protocol.messages import RoundMetrics
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import Topics
from provisioning.bridge import bridge_conf_text
from region.daemon import Region
from sim.broker import LocalBroker, start_broker
from sim.federation import SimSettings
from sim.regions import create_regions, region_names
from tests.fedharness import hosted_agent, override_toml, wait_until

FEDERATION = "t"


class RegionFederation:
    def __init__(self, root: Path, *, regions: int = 2, agents: int = 6, rounds: int = 2,
                 root_tables: dict | None = None, region_tables: dict[str, dict] | None = None) -> None:  # fmt: skip
        self.root_broker = start_broker(data_dir=root / "broker", kind="mosquitto")
        self.brokers: dict[str, LocalBroker] = {}
        for region in region_names(regions):
            bridge = bridge_conf_text(FEDERATION, region, self.root_broker.address)
            self.brokers[region] = start_broker(data_dir=root / f"broker-{region}", kind="mosquitto",
                                                extra_config=bridge)  # fmt: skip
        settings = SimSettings(agents=agents, rounds=rounds, regions=regions, federation=FEDERATION, deadline_s=20.0,
                               epochs=1, strategy={"name": "fedavg"})  # fmt: skip
        self.layout = create_regions(root / "fed", settings, (self.root_broker.host, self.root_broker.port),
                                     [(b.host, b.port) for b in self.brokers.values()])  # fmt: skip
        override_toml(self.layout.flat.server_config, **(root_tables or {}))
        for region, tables in (region_tables or {}).items():
            override_toml(self.layout.regions[region], **tables)
        self.server = Aggregator(load_server_config(self.layout.flat.server_config))
        self.regions = {name: Region(load_server_config(path)) for name, path in self.layout.regions.items()}
        self.agents = {name: hosted_agent(path) for name, path in self.layout.flat.agent_configs.items()}
        self.stop = threading.Event()
        runs = [self.server.run, *(r.run for r in self.regions.values()), *(a.run for a in self.agents.values())]
        self.threads = [threading.Thread(target=run, args=(self.stop,), daemon=True) for run in runs]
        self.metrics: list[RoundMetrics] = []
        self.watcher = MqttClient("test-watcher", BrokerSettings(self.root_broker.host, self.root_broker.port),
                                  persistent=False)  # fmt: skip
        self.watcher.subscribe(Topics(FEDERATION).server_metrics)
        self._listen = threading.Thread(target=self._collect, daemon=True)

    def __enter__(self) -> RegionFederation:
        assert self.watcher.start(timeout_s=10)
        self._listen.start()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)
        self.watcher.stop()
        for broker in [*self.brokers.values(), self.root_broker]:
            broker.stop()

    def _collect(self) -> None:
        while not self.stop.is_set():
            message = self.watcher.poll(0.05)
            if message is not None:
                self.metrics.append(RoundMetrics.from_json(message[1]))

    def root_rounds(self, count: int, timeout_s: float = 120.0) -> list[RoundMetrics]:
        """Wait until the root has closed ``count`` rounds; its metrics, in order."""
        wait_until(lambda: len(self.metrics) >= count, timeout_s, f"{count} root rounds")
        return self.metrics[:count]

    def region_metrics(self, region: str) -> list[dict]:
        path = self.layout.regions[region].parent / "state" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
