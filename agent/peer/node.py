"""The peer (``skyfed agent run`` with ``federation.mode = "peer"``): keys and membership.

A role in an edge node (``agent.edge_node``), as the edge agent is: one MQTT connection and one loop, the
device gate, the session's last will, Prometheus. Its status is its retained, signed ``peer/<id>/member``
(its last will is a signed ``left``); it follows the
other peers' (``agent.peer.roster``: only enrolled, unrevoked peers count), opens the chunks sealed to
it on ``peer/+/to/<id>`` (``protocol.transfer.Reassembler`` with a ``security.envelope.Opener`` over the
enrolled keys) and hands the round work to ``agent.peer.rounds.PeerRounds``. Every refusal (a forged
membership, a stranger's chunk, a bad update) is logged with its reason, throttled, and survived. The device
gate is the node's (``agent.telemetry.Telemetry`` over ``[telemetry]`` and ``[gate]``): its reasons go in the
signed membership while the peer sits out. There is no server whose signed times would measure this device's
clock: the node's clock stays uncorrected (peers judge round times on their own monotonic clocks).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import paho.mqtt.client as paho

from agent.config import AgentConfig
from agent.edge_node import EdgeNode
from agent.peer.collect import transfer_limits
from agent.peer.roster import MembershipRefused, Roster
from agent.peer.rounds import PeerRounds
from agent.standing import Standing
from common.untrusted_json import UntrustedJsonError, parse_untrusted_json
from flcore.validation import reason_kind
from participant.jobs import Runner
from participant.upload import Upload, send_sealed
from protocol.messages import MAX_JSON_BYTES, Gate, MessageError
from protocol.peer_messages import PeerBest, PeerMember
from protocol.topics import Topics
from protocol.transfer import Reassembler, TransferRejected
from security.envelope import Opener
from security.keys import Identity
from security.signing import InvalidDocument, verify_document

if TYPE_CHECKING:
    from models.evaluators import Evaluator

log = logging.getLogger("skyfed.peer")
KINDS = frozenset({"peer-update", "peer-model"})


class PeerNode:
    """The peer role: an edge node's work in a federation of peers (``run`` runs its node)."""

    def __init__(
        self, config: AgentConfig, *, runner: Runner | None = None, evaluator: Evaluator | None = None
    ) -> None:
        self.config = config
        self.id = config.agent.id
        self.topics = Topics(config.agent.federation)
        self.identity = Identity.load(config.identity_path)
        if self.identity.name != self.id:
            raise ValueError(f"{config.identity_path} holds the key of {self.identity.name!r}, not of agent.id "
                             f"{self.id!r}: fix keys.identity")  # fmt: skip
        self.roster = Roster(self.id, self.topics.federation, config.enrolled_dir)
        self.uploads: list[Upload] = []
        self._announce = False
        self.status_topic = self.topics.peer_member(self.id)
        self.work = PeerRounds(self, config, runner=runner, evaluator=evaluator)
        opener = Opener(identity=self.identity, federation=self.topics.federation, senders=self.roster.keyring)
        self.reassembler = Reassembler(opener, transfer_limits(self.work.model))
        self.edge = EdgeNode(config, self.identity, self, log)
        self.runner.notify = self.edge.mqtt.wake  # a finished job is acted on at once, not a tick later

    def run(self, stop: threading.Event | None = None) -> None:
        self.edge.run(stop)

    # EdgeRole ----------------------------------------------------------------------------------------
    def subscriptions(self) -> list[str]:
        return [self.topics.peer_wildcard("member"), self.topics.peer_wildcard("best"),
                self.topics.peer_wildcard(f"to/{self.id}")]  # fmt: skip

    def started(self) -> None:
        plan = self.config.federation
        log.info("peer started id=%s federation=%s enrolled=%d rounds=%d threshold=%d strategy=%s",
                 self.id, self.topics.federation, len(self.roster.keyring), plan.rounds, plan.threshold,
                 self.work.strategy.name)  # fmt: skip
        if self.id not in self.roster.keyring:
            log.warning("this peer's own key is not in keys.enrolled (%s): the other peers refuse its membership and "
                        "models; enrol it in every peer's folder", self.config.enrolled_dir)  # fmt: skip

    def handle(self, topic: str, payload: bytes) -> None:
        where = self.topics.peer_of(topic)
        if where is None:
            return
        peer, leaf = where
        if leaf == "member":
            self._on_member(peer, payload)
        elif leaf == "best":
            self._on_best(peer, payload)
        elif leaf == f"to/{self.id}":
            self._on_chunk(peer, payload)

    def tick(self) -> None:
        for peer in self.roster.poll(time.monotonic()):
            self.work.drop(peer, "revoked")
        for rejection in self.reassembler.expire():
            self.warn("transfer-timeout", "transfer expired reason=%s", rejection.reason)
        self.uploads = [u for u in self.uploads if self._still_sending(u)]
        connected = self.edge.mqtt.connected.is_set()
        if self._announce and connected:
            self._announce = False
            self.work.announce()
        self.work.step(connected)

    def _still_sending(self, upload: Upload) -> bool:
        outcome = upload.check(self.edge.mqtt)
        if outcome == "acknowledged":
            self.edge.metrics.update_sent(upload.size)
        return outcome == "waiting"

    def finished(self) -> bool:
        return self.work.done and not self.uploads

    def describe(self) -> str:
        return self.work.describe()

    def progress_fields(self) -> str:
        return f"round={self.work.round}"

    def standing(self) -> Standing:
        w = self.work
        return Standing(w.phase, w.round, w.client.progress.last_completed_round, tuple(w.gated))

    def final_status(self) -> paho.MQTTMessageInfo | None:
        self.work.close()
        return self.publish_member("left", self.work.round)

    def offline(self, session: float) -> dict:
        return PeerMember(self.topics.federation, self.id, "left", 0, session, session).to_dict()

    def connected(self) -> None:
        self._announce = True  # the loop re-publishes the membership (a restarted broker may have lost it)

    @property
    def runner(self) -> Runner:
        """The trainer's runner (``sim.agent_host`` wraps an in-process runner's trainer)."""
        return self.work.client.runner

    # what the round work uses ------------------------------------------------------------------------
    def members(self) -> list[str]:
        """Current trusted members, this peer included once it is one."""
        return self.roster.current()

    def publish_member(self, state: str, round_number: int) -> paho.MQTTMessageInfo | None:
        """Its signed membership, with the reasons its gate keeps it out of the rounds (``PeerRounds.gated``)."""
        gated = self.work.gated
        member = PeerMember(self.topics.federation, self.id, state, round_number, self.edge.session, time.time(),
                            Gate(ok=not gated, reasons=list(gated)))  # fmt: skip
        self.roster.members[self.id] = member  # its own counts at once, not when the broker echoes it
        return self.edge.publish_status(member.to_dict())

    def publish_best(self, best: PeerBest) -> None:
        self.edge.publish_signed(self.topics.peer_best(self.id), best.to_dict())

    def publish_metrics(self, body: dict) -> None:
        self.edge.publish_signed(self.topics.peer_metrics(self.id), body)

    def seal_to(self, peer: str, kind: str, round_number: int, data: bytes) -> int:
        """Seal ``data`` to ``peer`` on ``peer/<me>/to/<peer>``; the bytes handed to the broker (0: unknown peer)."""
        recipient = self.roster.keyring.get(peer)
        if recipient is None:
            return 0
        upload = send_sealed(self.edge.mqtt, self.topics.peer_to(self.id, peer), data, sender=self.identity,
                             recipient=recipient, federation=self.topics.federation, kind=kind,
                             round=round_number)  # fmt: skip
        self.uploads.append(upload)
        return upload.size

    def warn(self, key: str, message: str, *args: object) -> None:
        self.edge.warn(key, message, *args)

    def _key(self, what: str, peer: str, reason: str = "") -> str:
        """A refusal's throttle key: its kind without the values, and strangers' topic names as one, so that
        varying a value or a made-up peer name is no log flood."""
        return f"{what}-{peer if peer in self.roster.keyring else '(stranger)'}-{reason_kind(reason)}"

    # received ----------------------------------------------------------------------------------------
    def _on_member(self, peer: str, payload: bytes) -> None:
        if peer == self.id:
            return  # its own, echoed back (or retained from its last run): it knows better
        try:
            member = self.roster.consider(peer, payload)
        except MembershipRefused as exc:
            self.warn(self._key("member", peer, exc.reason), "membership refused peer=%s reason=%s", peer, exc.reason)
            return
        if member is not None:
            gate = "" if member.gate.ok else f" gate=closed ({'; '.join(member.gate.reasons)[:200]})"
            log.info("membership peer=%s state=%s round=%d%s members=%s", peer, member.state, member.round, gate,
                     ",".join(self.members()))  # fmt: skip
            if member.state == "joining":
                self.work.catch_up(peer)

    def _on_best(self, peer: str, payload: bytes) -> None:
        if not payload or peer == self.id:
            return
        try:
            document = parse_untrusted_json(payload, max_bytes=MAX_JSON_BYTES)
            best = PeerBest.from_dict(verify_document(document, self.roster.keyring))
        except (UntrustedJsonError, MessageError) as exc:
            self.warn(self._key("best", peer), "best model claim refused peer=%s reason=malformed: %s", peer, exc)
            return
        except InvalidDocument as exc:
            reason = self.roster.why_untrusted(peer) if exc.reason == "unknown-signer" else exc.reason
            self.warn(self._key("best", peer), "best model claim refused peer=%s reason=%s", peer, reason)
            return
        if best.peer != peer or document["signer"] != peer or best.federation != self.topics.federation:
            self.warn(self._key("best", peer), "best model claim refused peer=%s reason=peer-mismatch", peer)
            return
        self.work.note_claim(best)

    def _on_chunk(self, peer: str, payload: bytes) -> None:
        try:
            completed = self.reassembler.feed(payload, topic_sender=peer, kinds=KINDS)
        except TransferRejected as exc:
            reason = self.roster.why_untrusted(peer) if exc.reason == "unknown-sender" else exc.reason
            self.warn(self._key("chunk", peer, reason), "transfer refused peer=%s reason=%s", peer, reason)
            return
        if completed is None:
            return
        if peer not in self.members():
            self.warn(f"nonmember-{peer}", "%s refused peer=%s reason=not-a-member", completed.manifest.kind, peer)
            return
        manifest = completed.manifest
        if manifest.kind == "peer-update":
            self.work.receive_update(peer, manifest.round, completed.data, completed.wire_bytes)
        else:
            self.work.receive_model(peer, manifest.round, completed.data)
