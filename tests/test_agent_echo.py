"""An agent the broker's ACL does not name yet (provisioned, mosquitto not reloaded) says that the broker drops
what it sends, against a real mosquitto started from the files ``skyfed provision`` writes."""

from __future__ import annotations

import threading

from agent.echo import PublishEcho
from sim.classify_layout import write_classify_data
from tests.fedharness import hosted_agent, override_toml, wait_until
from tests.liveharness import provision

DROPPED = "the broker drops what this agent publishes"


def test_an_agent_missing_from_the_loaded_acl_says_its_publishes_are_dropped(provisioned):  # noqa: F811
    out, state, broker, port = provisioned
    provision(out, "a1,a2,a3,a4", port, state)  # a4 added; the running broker still holds the old ACL
    write_classify_data(state, ["a1", "a4"], "iid", seed=0)
    agents = {}
    for name in ("a1", "a4"):
        config = out / "agents" / name / "agent.toml"
        override_toml(config, agent={"status_interval_s": 0.5})
        agents[name] = hosted_agent(config)
        agents[name].edge.echo = PublishEcho(timeout_s=3.0)
    stop = threading.Event()
    threads = [threading.Thread(target=a.run, args=(stop,), daemon=True) for a in agents.values()]
    for thread in threads:
        thread.start()
    try:
        problem = wait_until(lambda: agents["a4"].edge.mqtt.problem, 20, "a4 reports a problem")
        assert DROPPED in problem and "systemctl reload mosquitto" in problem  # on main: "mqtt connected", silence
        status = agents["a4"].report.status()  # what systemd's STATUS= gets too (protocol.daemon adds the problem)
        assert status.state == "unreachable" and DROPPED in status.detail
        assert agents["a1"].edge.mqtt.problem is None and agents["a1"].edge.mqtt.connected.is_set()
        broker.reload()  # what the operator is told to do
        wait_until(lambda: agents["a4"].edge.mqtt.problem is None, 20, "a4's status comes back after the reload")
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)


def test_the_echo_clock_runs_only_while_connected_and_says_it_once():
    now = [0.0]
    echo = PublishEcho(timeout_s=10.0, clock=lambda: now[0])
    echo.sent(b"s1")
    now[0] = 9.0
    assert not echo.overdue(connected=True)
    assert not echo.overdue(connected=False)  # disconnected: the clock restarts with the next status
    echo.sent(b"s2")
    now[0] = 18.0
    assert not echo.overdue(connected=True)
    now[0] = 19.5
    assert echo.overdue(connected=True) and not echo.overdue(connected=True)
    assert not echo.came_back(b"someone else's") and echo.came_back(b"s1") and not echo.dropped
