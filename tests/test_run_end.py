"""The end of a run is said on both sides: the server logs one final line, its agents notice and say so."""

from __future__ import annotations

import json
import logging
import threading

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from sim.federation import SimSettings, create_federation
from tests.fedharness import hosted_agent, override_toml, wait_until


def test_the_last_round_is_followed_by_a_final_line_and_the_agents_hear_of_it(tmp_path, broker, caplog):
    layout = create_federation(tmp_path / "fed", SimSettings(agents=2, rounds=1, federation="fleet"),
                               (broker.host, broker.port))  # fmt: skip
    for config in layout.agent_configs.values():
        override_toml(config, agent={"status_interval_s": 0.5})
    server = Aggregator(load_server_config(layout.server_config))
    agents = [hosted_agent(p) for p in layout.agent_configs.values()]
    stop = threading.Event()
    threads = [threading.Thread(target=a.run, args=(stop,), daemon=True) for a in agents]
    for thread in threads:
        thread.start()
    try:
        with caplog.at_level(logging.INFO):
            server.run()  # returns after its one round: the final retained status says "finished"
            wait_until(lambda: all(a.run_end.ended is not None for a in agents), 20, "agents noticed the end")
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    lines = [r.getMessage() for r in caplog.records]
    final = [line for line in lines if line.startswith("run finished rounds=")]
    assert len(final) == 1 and "final model version=2" in final[0] and "eval=0." in final[0]
    assert f"out={layout.server_config.parent / 'state' / 'global_model.safetensors'}" in final[0]
    noticed = [line for line in lines if line.startswith("run finished at the server")]
    assert len(noticed) == 2 and "after round 1" in noticed[0]
    for agent in agents:
        assert "run is over after round 1" in agent.report.status().detail
        assert agent.edge.systemd_status().endswith("the server's run is over")


def test_a_finished_run_restarted_says_it_is_over_and_how_to_start_a_new_one(tmp_path, broker, caplog):
    layout = create_federation(tmp_path / "fed", SimSettings(agents=1, rounds=1, federation="fleet"),
                               (broker.host, broker.port))  # fmt: skip
    config = load_server_config(layout.server_config)
    state = config.state_dir / "checkpoint" / "state.json"
    Aggregator(config)  # a fresh run: initialised
    data = json.loads(state.read_text())
    data["next_round"] = 2  # its one round done
    state.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        restarted = Aggregator(config)
    status = json.loads(restarted.report.json())
    assert (status["state"], status["phase"]) == ("finished", "finished")  # the review found phase=starting
    said = [r.getMessage() for r in caplog.records if "already over" in r.getMessage()]
    assert said == [f"this run is already over (1 rounds done): to start a new run, move {config.state_dir} aside, "
                    "or raise server.rounds to go on with this one"]  # fmt: skip
