"""``skyfed provision --upstream``: a region's files under a root, run on real mosquittos with mutual TLS, the
provisioned ACLs and the provisioned bridge."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from common import toml
from region.daemon import Region
from sim.broker import free_port, start_broker
from sim.federation import write_classify_data
from skyfed import main
from tests.fedharness import hosted_agent, override_toml

ROOT_FED, REGION_FED = "fleet", "fleet-east"


def provision(out: Path, federation: str, agents: str, port: int, state: Path, *extra: str) -> int:
    return main(["provision", "--federation", federation, "--agents", agents, "--out", str(out), "--broker",
                 f"127.0.0.1:{port}", "--listen", "127.0.0.1", "--state-dir", str(state), "--any-state-dir",
                 *extra])  # fmt: skip


def test_a_provisioned_region_takes_part_in_its_roots_rounds_over_the_bridge(workdir: Path) -> None:
    root_port, region_port = free_port(), free_port()
    root, east, state = workdir / "root", workdir / "east", workdir / "state"
    assert provision(root, ROOT_FED, "region-1", root_port, state / "root") == 0
    assert provision(east, REGION_FED, "d1,d2", region_port, state / "east", "--upstream",
                     str(root / "agents" / "region-1")) == 0  # fmt: skip
    config = toml.loads((east / "server" / "server.toml").read_text())
    assert config["upstream"]["id"] == "region-1" and config["upstream"]["federation"] == ROOT_FED
    bridge = (east / "broker" / "bridge.conf").read_text()
    assert f"address 127.0.0.1:{root_port}" in bridge and "remote_clientid region-1" in bridge
    assert "user region-1" in (east / "broker" / "skyfed.acl").read_text()  # the participant on the region's broker

    write_classify_data(state / "east", ["d1", "d2"], "iid", seed=0)
    override_toml(root / "server" / "server.toml", server={"rounds": 2, "status_interval_s": 1.0},
                  rounds={"min_agents": 1, "quorum": 1, "deadline_s": 40.0}, strategy={"name": "fedavg"})  # fmt: skip
    override_toml(east / "server" / "server.toml", server={"eval_data": str(state / "east" / "server" / "test.npz"),
                  "status_interval_s": 1.0}, rounds={"min_agents": 2, "quorum": 2, "deadline_s": 15.0},
                  strategy={"name": "fedavg"}, training={"epochs": 1})  # fmt: skip
    for name in ("d1", "d2"):
        override_toml(east / "agents" / name / "agent.toml", agent={"status_interval_s": 1.0}, training={"threads": 1})
    root_broker = start_broker(data_dir=workdir / "root-broker", kind="mosquitto", port=root_port,
                               config_file=root / "broker" / "skyfed.conf")  # fmt: skip
    combined = workdir / "east-mosquitto.conf"  # as conf.d would include both files
    combined.write_text((east / "broker" / "skyfed.conf").read_text() + bridge)
    region_broker = start_broker(data_dir=workdir / "east-broker", kind="mosquitto", port=region_port,
                                 config_file=combined)  # fmt: skip
    server = Aggregator(load_server_config(root / "server" / "server.toml"))
    region = Region(load_server_config(east / "server" / "server.toml"))
    agents = [hosted_agent(east / "agents" / name / "agent.toml") for name in ("d1", "d2")]
    stop = threading.Event()
    threads = [threading.Thread(target=d.run, args=(stop,), daemon=True) for d in (region, *agents)]
    server_thread = threading.Thread(target=server.run, daemon=True)
    try:
        for thread in [*threads, server_thread]:
            thread.start()
        server_thread.join(150)
        assert not server_thread.is_alive(), "the root's run did not finish"
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        region_broker.stop()
        root_broker.stop()
        print(f"--- root broker ---\n{root_broker.log_tail(30)}\n--- region broker ---\n{region_broker.log_tail(30)}")
    rows = [json.loads(line) for line in (state / "root" / "server" / "metrics.jsonl").read_text().splitlines()]
    assert [r["accepted"] for r in rows] == [["region-1"], ["region-1"]]
    regional = (state / "east" / "server" / "metrics.jsonl").read_text().splitlines()
    assert [sorted(json.loads(line)["accepted"]) for line in regional] == [["d1", "d2"]] * 2


def test_upstream_must_be_a_roots_region_folder_and_the_region_its_own_federation(workdir: Path, capsys) -> None:
    root, port = workdir / "root", free_port()
    assert provision(root, ROOT_FED, "region-1", port, workdir / "s") == 0
    assert provision(workdir / "x", REGION_FED, "d1", port, workdir / "s", "--upstream", str(workdir)) == 2
    assert "not a folder the root's skyfed provision wrote for a region" in capsys.readouterr().err
    assert provision(workdir / "y", ROOT_FED, "d1", port, workdir / "s", "--upstream",
                     str(root / "agents" / "region-1")) == 2  # fmt: skip
    assert "is the root's federation too" in capsys.readouterr().err


def test_the_deploy_example_bridge_is_what_provision_writes() -> None:
    from provisioning.bridge import BridgeTls, bridge_conf_text

    installed = Path("/etc/mosquitto/skyfed/upstream")
    tls = BridgeTls(installed / "ca.crt", installed / "region-east.crt", installed / "region-east.crt.key")
    example = Path(__file__).resolve().parent.parent / "deploy" / "mosquitto" / "bridge.conf"
    assert example.read_text() == bridge_conf_text("fleet", "region-east", "root.example:8883", tls)
