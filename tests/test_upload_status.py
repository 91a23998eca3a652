"""An agent's status says "uploading" only while the broker's acknowledgement of its update is late: on a good link
"done" follows within milliseconds, and a status replaced that soon would cost the agent, the broker and the
server a signed message each for nothing (``agent.daemon.EdgeAgent._send``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sim.federation import SimSettings, create_federation
from tests.fedharness import hosted_agent, round_task


@pytest.fixture
def agent(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    agent = hosted_agent(layout.agent_configs["agent-01"])
    agent.said = []  # the states of the statuses it published, in order
    agent.edge.publish_status = lambda body: agent.said.append(body["state"]) or SimpleNamespace()  # paho's info
    agent.client.send = lambda *args: setattr(agent.client, "upload", SimpleNamespace(size=10))
    agent.task = round_task(selected=["agent-01"], pending=["agent-01"])
    agent.state = "training"
    return agent


def acknowledgements(agent, *answers: str) -> None:  # noqa: ANN001
    """The broker's answers to the agent's next steps, as ``RoundClient.check_upload`` gives them."""
    replies = iter(answers)
    agent.client.check_upload = lambda mqtt, task: next(replies)


def test_an_update_acknowledged_at_once_goes_from_training_to_done(agent):
    acknowledgements(agent, "acknowledged")
    agent._send(agent.task, b"sealed")
    assert agent.state == "uploading" and agent.said == []
    agent._check_upload()
    assert agent.said == ["done"]


def test_a_late_acknowledgement_is_said_uploading_once_then_done(agent):
    acknowledgements(agent, "waiting", "waiting", "acknowledged")
    agent._send(agent.task, b"sealed")
    agent._check_upload()
    assert agent.said == ["uploading"]
    agent._check_upload()
    assert agent.said == ["uploading"], "said once, not at every step"
    agent._check_upload()
    assert agent.said == ["uploading", "done"]


def test_an_upload_given_up_on_is_said_too(agent):
    acknowledgements(agent, "timed-out")
    agent._send(agent.task, b"sealed")
    agent._check_upload()
    assert agent.said == ["uploading"]


def test_a_status_held_back_is_not_taken_as_said(agent):
    held = []
    agent.edge.publish_status = lambda body: held.append(body["state"])  # None: held back (an older one in flight)
    acknowledgements(agent, "waiting", "waiting")
    agent._send(agent.task, b"sealed")
    agent._check_upload()
    agent._check_upload()
    assert held == ["uploading", "uploading"], "tried again at the next step"
