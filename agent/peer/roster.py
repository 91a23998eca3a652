"""Who a peer trusts and who is in the federation now.

Trust is the ``keys.enrolled`` folder: every peer's ``.pub``, watched like the server's (a file that
disappears — ``skyfed provision revoke`` moves it to ``revoked/`` — drops that peer at once, without a
restart). The keyring is shared with the peer's ``Opener``, so a dropped peer's chunks are refused
(``unknown-sender``) from then on. Membership is each peer's signed, retained ``peer/<id>/member``: a
document counts only when the topic, the body and the signer name the same enrolled, unrevoked peer
of this federation; anything else is refused with its reason (``MembershipRefused``), and a document
older than the one held for that peer (a replay) or a ``left`` of an earlier connection changes nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

from common.untrusted_json import UntrustedJsonError, parse_untrusted_json
from protocol.messages import MAX_JSON_BYTES, MessageError
from protocol.peer_messages import PeerMember, older
from security.enrolled_watch import EnrolledWatch
from security.keys import Keyring, revoked_names
from security.signing import InvalidDocument, verify_document

log = logging.getLogger("skyfed.peer")


class MembershipRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Roster:
    def __init__(self, me: str, federation: str, enrolled_dir: Path) -> None:
        self.me = me
        self.federation = federation
        self.enrolled_dir = enrolled_dir
        self.keyring = Keyring()
        self.members: dict[str, PeerMember] = {}
        self.watch = EnrolledWatch(enrolled_dir, self.keyring, role="peer", log=log)
        self.poll(0.0)

    def poll(self, now: float) -> list[str]:
        """Apply changes to the enrolled folder (``security.enrolled_watch``, at most once a second); the peers
        no longer trusted."""
        gone = list(self.watch.poll(now).revoked)
        for name in gone:
            self.members.pop(name, None)
            log.warning("peer revoked peer=%s: its membership, models and scores are refused from now on", name)
        return gone

    def why_untrusted(self, peer: str) -> str:
        """``revoked`` or ``not-enrolled`` (for a refusal's log line)."""
        return "revoked" if peer in revoked_names(self.enrolled_dir) else "not-enrolled"

    def consider(self, topic_peer: str, payload: bytes) -> PeerMember | None:
        """Apply one retained membership document; the membership it set (None: cleared or not newer), or
        ``MembershipRefused``."""
        if not payload:  # the retained document was cleared
            self.members.pop(topic_peer, None)
            return None
        if topic_peer not in self.keyring:
            raise MembershipRefused(self.why_untrusted(topic_peer))
        try:
            document = parse_untrusted_json(payload, max_bytes=MAX_JSON_BYTES)
            member = PeerMember.from_dict(verify_document(document, self.keyring))
        except UntrustedJsonError:
            raise MembershipRefused("malformed") from None
        except InvalidDocument as exc:
            raise MembershipRefused(exc.reason) from None
        except (MessageError, ValueError) as exc:
            raise MembershipRefused(f"malformed: {exc}") from None
        if member.peer != topic_peer or document["signer"] != topic_peer:
            raise MembershipRefused(f"peer-mismatch: {member.peer} on {topic_peer}'s topic")
        if member.federation != self.federation:
            raise MembershipRefused(f"wrong-federation: {member.federation}")
        held = self.members.get(topic_peer)
        if held is not None and older(member, held):
            return None  # older than what is held: a replay, or the will of an earlier connection
        if member.state == "left":
            self.members.pop(topic_peer, None)
            return member
        self.members[topic_peer] = member
        return member

    def current(self) -> list[str]:
        """Trusted members taking part (this peer included once it is one), sorted: everyone a round's update goes
        to and waits for. A member whose gate is closed sits out: whatever its reasons, nobody waits for it."""
        return sorted(p for p, m in self.members.items() if m.state == "member" and m.gate.ok and p in self.keyring)

    def sitting_out(self) -> list[str]:
        """Trusted members whose gate is closed: here (a federation starts without waiting for them), not waited for."""
        return sorted(p for p, m in self.members.items() if m.state == "member" and not m.gate.ok and p in self.keyring)

    def joining(self) -> list[str]:
        return sorted(p for p, m in self.members.items() if m.state == "joining" and p in self.keyring)
