"""``skyfed provision --mode peer``: a federation with no server, whose peers trust one another's keys.

    DIR/provision.json   as in client mode, with "mode": "peer"
    DIR/ca/, DIR/broker/, DIR/monitor/, with --ws-port DIR/dashboard/
                         as in client mode; the ACL is ``broker_files.peer_acl_text`` (a peer writes only
                         ``peer/<itself>/#``), the monitor and the dashboard read membership, metrics and best
                         scores (with each peer's election decision)
    DIR/enrolled/        every peer's .pub, ``revoked/`` inside: the master copy of what each peer trusts
    DIR/peers/<id>/      agent.toml ([federation] mode = "peer"), <id>.key/.pub, <id>.crt and key, ca.crt,
                         enrolled/ (every peer's .pub, this one's included; ``revoked/`` inside)

Running it again with more peers adds their keys to every peer folder still here (existing keys stay);
``revoke_peer`` moves a peer's .pub to ``revoked/`` in DIR/enrolled and in every peer folder still here,
puts its certificate in the CRL and takes it out of the ACL. A peer folder already installed on its device
gets the change with ``skyfed keys enroll|revoke ... --enrolled /etc/skyfed/enrolled`` there.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from protocol.config import write_toml
from provisioning.provision import (
    Layout,
    Provisioning,
    certificate,
    finish,
    load_plan,
    revocation,
    start,
    tls_settings,
)
from security.keys import REVOKED, Identity, KeyFileError, PublicIdentity, enroll, revoke
from security.pki import serial_of

# What provisioning cannot choose for the operator: the round plan, which must be the same on every peer
# (agent.peer.plan defines its keys; a peer refuses to start without them, naming the key).
ROUND_PLAN_NOTE = """\
# TO FILL IN: the round plan, the same in every peer's agent.toml (skyfed agent check names a missing key), e.g.
# model = "digits_cnn"
# rounds = 5
# threshold = 3           # peer updates a peer waits for each round, its own included (all peers: wait for all)
# round_timeout_s = 120.0
# [federation.strategy]  # unset: auto, the server's measured default (docs/results/robustness.md)
# name = "auto"
"""


def provision_peers(out: Path, plan: Provisioning, peers: list[str]) -> list[str]:
    """Create (or extend) the peer federation in ``out``; return the peers that are new."""
    layout = start(out, plan, peers)
    new = [name for name in peers if name not in plan.agents]
    for name in new:
        _peer_node(layout, plan, name)
        plan.agents.append(name)
    _share_enrolment(layout, plan)
    finish(layout, plan)
    return new


def revoke_peer(out: Path, peer: str) -> int:
    """Stop trusting ``peer`` in every peer folder here, the CRL and the ACL; return its certificate serial."""
    layout = Layout(out)
    plan = load_plan(out)
    plan.revoked.append(revoked := revocation(layout, plan, peer))
    if (layout.peers_enrolled / f"{peer}.pub").exists():
        revoke(layout.peers_enrolled, peer)
    _share_enrolment(layout, plan)
    finish(layout, plan)
    return int(revoked.serial, 16)


def _peer_node(layout: Layout, plan: Provisioning, name: str) -> None:
    directory = layout.peer(name)
    identity = Identity.generate(name)
    identity.save(directory)
    certificate(layout, directory, name)
    plan.serials[name] = f"{serial_of(directory / f'{name}.crt'):x}"
    enroll(layout.peers_enrolled, identity.public)
    state = f"{plan.state_dir}/{name}"
    config = directory / "agent.toml"
    write_toml(
        config,
        {
            "agent": {"id": name, "federation": plan.federation, "state_dir": state, "data": f"{state}/data.npz",
                      "test_data": f"{state}/test.npz"},  # fmt: skip
            "broker": {"host": plan.broker_host, "port": plan.broker_port, "tls": tls_settings(name)},
            "keys": {"identity": f"{name}.key", "enrolled": "enrolled"},
            "federation": {"mode": "peer"},
        },
        footer=ROUND_PLAN_NOTE,
    )


def _share_enrolment(layout: Layout, plan: Provisioning) -> None:
    """Make every peer folder here trust exactly the master copy: each active peer's .pub enrolled (written
    only when it differs, so a running peer sees no change), each revoked one moved to ``revoked/``."""
    master = layout.peers_enrolled
    active = [PublicIdentity.load(master / f"{name}.pub") for name in plan.agents if name not in plan.revoked_names()]
    for folder in (layout.peer(name) / "enrolled" for name in plan.agents):
        if not folder.parent.exists():  # gone to its device
            continue
        for public in active:
            if not _holds(folder / f"{public.name}.pub", public):
                enroll(folder, public)
        for name in sorted(plan.revoked_names()):
            if (folder / f"{name}.pub").exists():
                revoke(folder, name)
            elif (master / REVOKED / f"{name}.pub").exists() and not (folder / REVOKED / f"{name}.pub").exists():
                (folder / REVOKED).mkdir(exist_ok=True)
                shutil.copyfile(master / REVOKED / f"{name}.pub", folder / REVOKED / f"{name}.pub")


def _holds(path: Path, public: PublicIdentity) -> bool:
    try:
        held = PublicIdentity.load(path)
    except KeyFileError:  # missing or unreadable: written again
        return False
    return (held.name, held.raw()) == (public.name, public.raw())
