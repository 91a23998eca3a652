"""The participant's round work without an edge agent daemon (``participant.round_client``): what a peer or
the server's shared-pool trainer drives. A real broker, real sealing, a trainer in this process."""

from __future__ import annotations

import time

import numpy as np
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from flcore.update import TrainResult, UpdateMeta
from models.serialization import loads
from models.weights import fingerprint
from participant.jobs import Cancelled, Failed, InProcessRunner, Trained
from participant.progress import ProgressStore
from participant.round_client import Destination, RoundClient
from protocol.messages import AgentStart
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import Topics
from protocol.transfer import Reassembler, TransferLimits
from security.envelope import Opener
from security.keys import Identity, Keyring
from sim.broker import free_port
from tests.fedharness import round_task, wait_until

NAME = "server-pool"


class Plus:
    """A trainer that moves every weight by ``step`` (its result is known exactly)."""

    budget = None

    def __init__(self, step: float) -> None:
        self.step = step

    def train(self, global_arrays, task, context=None):  # noqa: ANN001, ANN201 - participant.trainer.Trainer
        if not np.isfinite(self.step):
            raise ValueError("a trainer bug")
        return TrainResult({k: v + np.float32(self.step) for k, v in global_arrays.items()}, samples=7, loss=0.5)


def test_a_round_client_trains_stores_sends_and_counts_the_acknowledged_update_without_an_edge_agent(
    tmp_path, broker
):
    receiver, me, topics = Identity.generate("receiver"), Identity.generate(NAME), Topics("it")
    settings = BrokerSettings(host=broker.host, port=broker.port)
    listener = MqttClient("receiver", settings, persistent=False)
    listener.subscribe(topics.agent_update(NAME))
    link = MqttClient(NAME, settings, persistent=False)
    assert listener.start(timeout_s=10) and link.start(timeout_s=10)

    def client() -> RoundClient:
        destination = Destination(topics.agent_update(NAME), receiver.public)
        return RoundClient(NAME, InProcessRunner(Plus(0.25)), ProgressStore(tmp_path / "state"), identity=me,
                           federation="it", destination=destination)  # fmt: skip

    try:
        pool, task = client(), round_task(selected=[NAME], pending=[NAME])
        assert pool.new_run(task.run_id) is False  # a fresh store belongs to the empty run id
        base = {"w": np.zeros((2, 3), np.float32), "b": np.ones(3, np.float32)}
        pool.train(task, task.start_of(NAME), base)
        wait_until(lambda: pool.training.job.poll() is not None, 20, "training")
        report = pool.poll()
        assert report is not None and isinstance(report.outcome, Trained) and pool.training is None
        stored = pool.store.stored_update(task.round)
        assert report.update == stored and pool.progress.last_completed_round == 1 and pool.progress.sent_round == 0
        assert pool.owes(task)  # trained and stored, never acknowledged
        pool.send(link, task, stored, time.time())
        # the acknowledgement of its last chunk wakes the owner's loop, which then finds it acknowledged (paho marks
        # a message published only after its callback: the wake must not come first)
        wait_until(link.waiting, 20, "the broker's acknowledgement to wake the link's poll")
        assert link.poll(0) is None and pool.check_upload(link, task) == "acknowledged"
        assert (pool.progress.sent_round, pool.progress.sent_attempt) == (1, 1) and not pool.owes(task)
        opener = Opener(identity=receiver, federation="it", senders=Keyring([me.public]))
        reassembler, completed = Reassembler(opener, TransferLimits()), None
        while completed is None:
            message = listener.poll(10)
            assert message is not None, "the sealed update never arrived"
            completed = reassembler.feed(message[1], topic_sender=NAME, kinds=frozenset({"update"}))
        arrays, metadata = loads(completed.data)
        assert bytes(completed.data) == stored
        assert all(np.array_equal(arrays[k], np.full_like(base[k], 0.25)) for k in base)  # the delta, fp32
        assert UpdateMeta.from_metadata(metadata).samples == 7
        restarted = client()  # the progress is durable: a restart owes nothing for attempt 1, but a re-ask gets it
        assert restarted.progress.sent_round == 1 and not restarted.owes(task)
        again = round_task(selected=[NAME], pending=[NAME], attempt=2)
        assert restarted.owes(again) and restarted.resend(again) == stored
    finally:
        link.stop(5)
        listener.stop(5)


def test_the_acknowledgement_that_wakes_the_loop_is_known_before_paho_marks_the_message_published():
    """paho calls back on an acknowledgement before it marks the message published: the loop it wakes finds it
    acknowledged all the same, and no other message with it."""
    link = MqttClient(NAME, BrokerSettings(host="127.0.0.1", port=free_port()), persistent=False)  # not connected
    info = link.publish("skyfed/it/agent/x/update", b"chunk")  # queued: paho sends it once connected
    link.wake_when_acknowledged(info)
    assert not link.waiting() and not link.all_acknowledged([info])
    link._handle_publish(None, None, info.mid, ReasonCode(PacketTypes.PUBACK, "Success"), None)  # as paho's thread
    assert link.waiting() and link.all_acknowledged([info])
    assert not link.all_acknowledged([link.publish("skyfed/it/agent/x/update", b"another")])


def test_a_round_client_reports_what_its_job_did_and_keeps_nothing_of_a_refused_or_failed_one(tmp_path):
    me, receiver = Identity.generate(NAME), Identity.generate("receiver")
    task = round_task(selected=[NAME], pending=[NAME])
    for step, refuse, outcome in ((1.0, "revoked by the server: test", Cancelled), (np.nan, "", Failed)):
        pool = RoundClient(NAME, InProcessRunner(Plus(step)), ProgressStore(tmp_path), identity=me, federation="it",
                           destination=Destination("skyfed/it/agent/x/update", receiver.public))  # fmt: skip
        pool.train(task, task.start_of(NAME), {"w": np.zeros(2, np.float32)})
        wait_until(lambda: pool.training.job.poll() is not None, 20, "training")  # noqa: B023 - waited for here
        report = pool.poll(refuse=refuse)  # a refused one finished first, but may not be sent
        assert report is not None and report.update is None and isinstance(report.outcome, outcome)
        assert pool.store.stored_update(task.round) is None and pool.progress.last_completed_round == 0
        assert pool.failed_on(task) == (outcome is Failed)  # a failed attempt is not retried; a cancelled one is


def test_a_peers_round_client_stores_its_trained_model_naming_its_start_and_sends_nothing_itself(tmp_path):
    """``whole_model`` (a peer): the update is the trained model (its change over zero) naming the start model's
    fingerprint, so each receiver takes the change from its own model; the peer fans it out itself."""
    task = round_task(selected=["agent-01"], pending=["agent-01"])
    base = {"w": np.full((2, 3), 2.0, np.float32), "b": np.ones(3, np.float32)}
    peer = RoundClient("agent-01", InProcessRunner(Plus(0.25)), ProgressStore(tmp_path), whole_model=True)
    peer.train(task, AgentStart("agent-01", "peer", fingerprint(base)), base)
    wait_until(lambda: peer.training.job.poll() is not None, 20, "training")
    report = peer.poll()
    assert report is not None and isinstance(report.outcome, Trained) and report.update is not None
    assert peer.store.stored_update(task.round) == report.update and peer.progress.last_completed_round == 1
    arrays, metadata = loads(report.update)
    assert all(np.array_equal(arrays[k], base[k] + np.float32(0.25)) for k in base)  # the model, not the change
    assert UpdateMeta.from_metadata(metadata).base_sha256 == fingerprint(base)
    with pytest.raises(AssertionError, match="no destination"):
        peer.send(None, task, report.update, 0.0)  # type: ignore[arg-type] - the peer seals to each member itself
