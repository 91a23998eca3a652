"""Group key delivery under load: an agent whose statuses lag the key is not sent a key every 15 s,
a restarted agent still gets it at once, and a resent key the agent already holds changes nothing there.

Keys are real and sealed for real; the distributor's clock is a plain number the test moves on."""

from __future__ import annotations

from itertools import pairwise

import pytest

from agent.inbox import ServerInbox
from broker_server.agents.groupkeys import RESEND_MAX_S, RESEND_S, GroupKeyDistributor
from participant.progress import ProgressStore
from participant.start_models import StartModels
from protocol.messages import AgentStatus
from security.keys import Identity, Keyring

STATUS_EVERY_S = 2.0  # the sim's agents' status interval


class Fleet:
    """A distributor for one enrolled agent, its sends opened by that agent's own inbox."""

    def __init__(self, tmp_path) -> None:  # noqa: ANN001
        self.now = 1000.0
        self.server, self.agent = Identity.generate("server"), Identity.generate("agent-01")
        self.sends: list[float] = []
        self.chunks: list[bytearray] = []
        self.keys = GroupKeyDistributor(tmp_path / "group.key", identity=self.server, federation="it",
                                        keyring=Keyring([self.agent.public]), send=self._send,
                                        clock=lambda: self.now)  # fmt: skip
        self.inbox = ServerInbox(self.agent, self.server.public, "it", StartModels(ProgressStore(tmp_path / "agent")),
                                 lambda *_: None)  # fmt: skip
        self.previous: AgentStatus | None = None

    def _send(self, agent: str, chunks: list[bytearray]) -> None:
        self.sends.append(self.now)
        self.chunks = chunks

    def status(self, *, key_id: str = "", state: str = "idle") -> None:
        status = AgentStatus(agent="agent-01", state=state, round=0, samples=10, version=0, updated_at=self.now,
                             group_key_id=key_id)  # fmt: skip
        self.keys.on_status("agent-01", self.previous, status)
        self.previous = status

    def open_last_send(self) -> str:
        return [self.inbox.feed(bytes(c), frozenset({"groupkey"}), None, None) for c in self.chunks][-1]


@pytest.fixture
def fleet(tmp_path):
    return Fleet(tmp_path)


def test_statuses_that_lag_the_key_get_it_again_after_waits_that_double(fleet):
    """On main: a send with the first status 15 s on, 38 in 10 minutes (1,000 agents: 3,399 in 9 minutes)."""
    for _ in range(int(600 / STATUS_EVERY_S)):
        fleet.status()
        fleet.now += STATUS_EVERY_S
    gaps = [b - a for a, b in pairwise(fleet.sends)]
    assert len(fleet.sends) == 6
    assert gaps == pytest.approx([RESEND_S, 30, 60, 120, RESEND_MAX_S], abs=STATUS_EVERY_S)


def test_holding_the_key_ends_the_resends_and_a_later_loss_gets_it_at_once(fleet):
    fleet.status()
    fleet.now += 100
    fleet.status()  # the wait doubled to 30 s: sent again
    assert len(fleet.sends) == 2
    fleet.now += 1
    fleet.status(key_id=fleet.keys.key.key_id)
    fleet.now += 1
    fleet.status()  # lost it (a restart without a will): at once, the wait back at its start
    fleet.now += RESEND_S
    fleet.status()
    assert len(fleet.sends) == 4 and fleet.sends[-1] - fleet.sends[-2] == RESEND_S


def test_a_restarted_agent_gets_the_key_at_once_and_a_flapping_one_at_most_every_resend_s(fleet):
    fleet.status()
    for _ in range(10):  # offline and back every 6 s for a minute, never holding the key
        fleet.now += 3
        fleet.status(state="offline")
        fleet.now += 3
        fleet.status()
    assert fleet.sends == [1000.0, 1000.0 + 18, 1000.0 + 36, 1000.0 + 54]  # on main: one per reconnect, 11


def test_a_resent_key_the_agent_holds_is_no_news(fleet):
    fleet.status()
    assert fleet.open_last_send() == "groupkey"
    fleet.now += RESEND_S
    fleet.status()  # its status still lags
    assert fleet.open_last_send() == "groupkey-held"  # the daemon then resubscribes to nothing
    assert list(fleet.inbox.group_keys) == [fleet.keys.key.key_id]



def test_a_restart_soon_after_a_send_waits_the_shortest_time_not_the_grown_one(fleet):
    fleet.status()
    fleet.now += RESEND_S
    fleet.status()  # the second send: the next would wait 30 s
    fleet.now += 5
    fleet.status(state="offline")
    fleet.status()  # back 5 s after that send, maybe a new process that lost the key in flight
    for _ in range(10):
        fleet.now += 1
        fleet.status()
    assert len(fleet.sends) == 3 and fleet.sends[2] - fleet.sends[1] == RESEND_S


def test_the_last_confirmation_of_a_sent_key_says_so(tmp_path):
    """``on_status`` is True once every agent the key was sent to holds it (the server may open a round then),
    and only then: not for the first of two, nor for a status holding a key nobody waited for, nor again for the
    same key."""
    server, agents = Identity.generate("server"), [Identity.generate(f"agent-0{i}") for i in (1, 2)]
    keys = GroupKeyDistributor(tmp_path / "group.key", identity=server, federation="it",
                               keyring=Keyring([a.public for a in agents]), send=lambda *_: None)  # fmt: skip

    def status(name: str, key_id: str = "") -> AgentStatus:
        return AgentStatus(agent=name, state="idle", round=0, samples=10, version=0, updated_at=1.0,
                           group_key_id=key_id)  # fmt: skip

    assert not keys.on_status("agent-01", None, status("agent-01"))  # both are sent the key
    assert not keys.on_status("agent-02", None, status("agent-02"))
    held = keys.key.key_id
    assert not keys.on_status("agent-01", status("agent-01"), status("agent-01", held))  # agent-02's is out
    assert keys.on_status("agent-02", status("agent-02"), status("agent-02", held))
    assert not keys.on_status("agent-02", status("agent-02", held), status("agent-02", held))  # none awaited
    for _ in range(3):  # a rogue that drops the key and takes it again gets it again, but wakes nobody
        assert not keys.on_status("agent-02", status("agent-02", held), status("agent-02"))
        assert not keys.on_status("agent-02", status("agent-02"), status("agent-02", held))
    keys.rotate(["agent-01"])  # a new key: its last confirmation says so again
    assert keys.on_status("agent-01", status("agent-01"), status("agent-01", keys.key.key_id))
