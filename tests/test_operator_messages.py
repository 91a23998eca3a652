"""An operator is told what is wrong and what to do: an agent that is not enrolled, or whose key was
re-made after enrolment, is named by the server and says itself what it waits for."""

from __future__ import annotations

import logging
import threading
import time

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from protocol.messages import AgentStatus, ServerStatus
from security.keys import Identity, revoke
from tests.fedharness import Federation, hosted_agent, override_toml, wait_until


def test_unenrolled_and_re_keyed_agents_are_named_with_the_fix(tmp_path, broker, caplog, monkeypatch):
    from agent import waiting as agent_waiting

    monkeypatch.setattr(agent_waiting, "STUCK_LOG_S", 1.0)
    caplog.set_level(logging.WARNING)
    fed = Federation(tmp_path, broker, rounds=1, agents=5)
    server_dir = fed.layout.server_config.parent
    (server_dir / "enrolled" / "agent-03.pub").unlink()  # never enrolled
    revoke(server_dir / "enrolled", "agent-04")
    Identity.generate("agent-02").save(tmp_path / "agent-02")  # re-made after enrolment

    fed.agents[1] = hosted_agent(fed.layout.agent_configs["agent-02"])  # loads the new key
    fed.threads[1] = threading.Thread(target=fed.agents[1].run, args=(fed.stop,), daemon=True)
    override_toml(fed.layout.agent_configs["agent-05"], agent={"federation": "other"})  # a typo in its config
    fed.agents[4] = hosted_agent(fed.layout.agent_configs["agent-05"])
    fed.threads[4] = threading.Thread(target=fed.agents[4].run, args=(fed.stop,), daemon=True)
    server = Aggregator(load_server_config(fed.layout.server_config))
    stop = threading.Event()
    server_thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    server_thread.start()
    fed.start_agents()
    try:
        wait_until(lambda: "re-enrol this agent" in fed.agents[1].report.status().detail, 30, "re-enrol hint")
        wait_until(lambda: "is not enrolled there" in fed.agents[2].report.status().detail, 30, "not-enrolled hint")
        wait_until(lambda: "ignored-not-enrolled" in server.report.json().decode(), 30, "the server's count")
        wait_until(lambda: "ignored-revoked" in server.report.json().decode(), 30, "the revoked agent counted")
        wait_until(lambda: "ignored-wrong-federation" in server.report.json().decode(), 30, "the lost agent counted")
        wait_until(lambda: "status-bad-signature" in server.report.json().decode(), 30, "the re-keyed agent refused")
        said = lambda: any("no group key after" in r.getMessage() for r in caplog.records)  # noqa: E731
        wait_until(said, 30, "the agent's own log")
        status = AgentStatus.from_json(fed.agents[1].report.status().to_json())  # as published, so the monitor shows it
        assert status.state == "idle" and "keys enroll agent-02.pub" in status.detail
    finally:
        stop.set()
        server_thread.join(15)
        fed.close()
    ignored = [r.getMessage() for r in caplog.records if "agent ignored agent=agent-03" in r.getMessage()]
    assert len(ignored) == 1, ignored  # once, though the agent keeps publishing its status
    assert "skyfed keys enroll agent-03.pub --enrolled" in ignored[0] and "without a restart" in ignored[0]
    stuck = [r.getMessage() for r in caplog.records if "no group key after" in r.getMessage()]
    assert sum("agent-03 is not enrolled there" in line for line in stuck) == 1  # in its own log, once
    assert all("enrol or re-enrol this agent" in line for line in stuck)
    (lost,) = [r.getMessage() for r in caplog.records if "agent ignored agent=agent-05" in r.getMessage()]
    assert "reason=wrong-federation" in lost and "set federation = 'it' in its agent.toml" in lost
    (revoked,) = [r.getMessage() for r in caplog.records if "agent ignored agent=agent-04" in r.getMessage()]
    assert "reason=revoked" in revoked and "enrolled/revoked" in revoked
    refused = [r.getMessage() for r in caplog.records if "agent=agent-02 reason=status-bad-signature" in r.getMessage()]
    assert len(refused) == 1 and "re-enrol this agent: skyfed keys enroll agent-02.pub --enrolled" in refused[0]


def test_an_update_signed_by_another_key_says_re_enrol(tmp_path, broker):
    from tests.fedharness import ServerHarness

    with ServerHarness(tmp_path, broker) as h:
        h.announce_agents()
        update = h.update_bytes(h.random_delta(1), samples=100)
        h.publish_update("agent-01", h.sealed(Identity.generate("agent-01"), update))  # its key was re-made
        h.wait_rejection("bad-signature")
        h.publish_update("agent-01", h.sealed(h.agents["agent-01"], update))
        h.publish_update("agent-02", h.sealed(h.agents["agent-02"], update))
        metrics = h.wait_metrics()
    (rejection,) = metrics.rejected
    assert rejection.agent == "agent-01" and "re-enrol this agent" in rejection.reason


def test_another_federations_agents_on_a_shared_broker_are_not_called_misconfigured(tmp_path, broker, caplog):
    from protocol.topics import Topics
    from security.signing import signed_payload
    from tests.fedharness import ServerHarness

    caplog.set_level(logging.DEBUG, logger="skyfed.server")

    def status(name: str, identity: Identity) -> bytes:
        return signed_payload(AgentStatus(agent=name, state="idle", round=0, samples=100, version=1,
                                          updated_at=time.time()).to_dict(), identity)  # fmt: skip

    with ServerHarness(tmp_path, broker) as h:
        other = Topics("dash2")  # a second federation on the same broker, with ids like ours
        h.driver.publish(other.agent_status("agent-01"), status("agent-01", Identity.generate("agent-01")), retain=True)
        h.driver.publish(other.agent_status("agent-02"), status("agent-02", h.agents["agent-02"]), retain=True)
        wait_until(lambda: "ignored-wrong-federation" in h.server.report.json().decode(), 30, "our lost agent counted")
        time.sleep(1.0)  # both were delivered in order: the other federation's came first
        reported = ServerStatus.from_json(h.server.report.json())
    assert "ignored-wrong-federation=1" in reported.detail and reported.agents_online == 0, reported
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "dash2" in r.getMessage()]
    assert len(warned) == 1 and "agent=agent-02 reason=wrong-federation" in warned[0], warned
    (quiet,) = [r for r in caplog.records if "another federation's agent" in r.getMessage()]
    assert quiet.levelno == logging.DEBUG and "federation=dash2 agent=agent-01" in quiet.getMessage()
