"""An agent's status says "uploading" only at a step that finds the broker's acknowledgement of its update missing:
on a good link "done" follows within milliseconds, and a status replaced that soon would cost the agent, the
broker and the server a signed message each for nothing (``agent.daemon.EdgeAgent._send``). The agent's loop
(``_step``) is driven here with the broker's answers played by the test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sim.federation import SimSettings, create_federation
from tests.fedharness import hosted_agent, round_task


@pytest.fixture
def agent(tmp_path):
    """agent-01 just trained round 1 (its progress says so) and is about to hand its update to paho."""
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    agent = hosted_agent(layout.agent_configs["agent-01"])
    agent.said = []  # the states of the statuses it published, in order
    agent.edge.publish_status = lambda body: agent.said.append(body["state"]) or SimpleNamespace()  # paho's info
    agent.client.send = lambda *args: setattr(agent.client, "upload", SimpleNamespace(size=10))
    agent.task = round_task(selected=["agent-01"], pending=[])
    agent.client.progress.last_completed_round = 1
    agent.state = "training"
    return agent


def acknowledgements(agent, *answers: str) -> None:  # noqa: ANN001
    """The broker's answers at the agent's next steps, as ``RoundClient.check_upload`` gives them (it forgets the
    upload once acknowledged or given up on)."""
    replies = iter(answers)

    def check(mqtt, task) -> str:  # noqa: ANN001
        answer = next(replies)
        if answer != "waiting":
            agent.client.upload = None
        return answer

    agent.client.check_upload = check


def test_an_update_acknowledged_at_once_goes_from_training_to_done(agent):
    acknowledgements(agent, "acknowledged")
    agent._send(agent.task, b"sealed")
    assert agent.said == []
    agent._step()
    agent._step()
    assert agent.said == ["done"]


def test_a_late_acknowledgement_is_said_uploading_once_then_done(agent):
    acknowledgements(agent, "waiting", "waiting", "acknowledged")
    agent._send(agent.task, b"sealed")
    agent._step()
    assert agent.said == ["uploading"] and agent.state == "uploading"
    agent._step()
    assert agent.said == ["uploading"], "said once, not at every step"
    agent._step()
    assert agent.said == ["uploading", "done"]


def test_an_upload_given_up_on_ends_the_agents_part_of_the_round(agent):
    acknowledgements(agent, "waiting", "timed-out")
    agent._send(agent.task, b"sealed")
    agent._step()
    agent._step()
    assert agent.said == ["uploading", "done"]  # paho keeps re-sending; a later attempt that asks gets it again
