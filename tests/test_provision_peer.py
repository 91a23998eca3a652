"""``skyfed provision --mode peer``: a federation with no server, checked on disk and on a real mosquitto
started from the generated ``skyfed.conf`` (mutual TLS, the generated ACL and CRL), as test_provision.py
does for the client mode. The provisioning folder lives in a world-traversable temporary folder: run as
root, mosquitto drops to its own user before it loads its certificates."""

from __future__ import annotations

import json
import shutil
import stat
import threading
import time
from functools import partial
from pathlib import Path

import pytest
from cryptography import x509

from common import toml
from provisioning.broker_files import peer_acl_text
from security.keys import PublicIdentity
from skyfed import main
from tests.fedharness import wait_until
from tests.liveharness import FED, PEER_MODE, provision_exit
from tests.tlsharness import Client, add_observer, connects, node_tls

PEERS = f"skyfed/{FED}/peer"
provision = partial(provision_exit, mode=PEER_MODE)


def enrolled(folder: Path) -> tuple[list[str], list[str]]:
    """The names trusted in an enrolled folder, and those in its ``revoked/``."""
    return sorted(p.stem for p in folder.glob("*.pub")), sorted(p.stem for p in (folder / "revoked").glob("*.pub"))


def test_each_peer_folder_holds_its_identity_certificate_config_and_every_peers_key(workdir, capsys):
    out = workdir / "fed"
    assert provision(out, "p1,p2,p3") == 0
    assert "provisioned 3 peers" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["README.txt", "broker", "ca", "enrolled", "monitor", "peers",
                                                     "provision.json"]  # fmt: skip
    p1 = out / "peers" / "p1"
    assert sorted(p.name for p in p1.iterdir()) == ["agent.toml", "ca.crt", "enrolled", "p1.crt", "p1.crt.key",
                                                    "p1.key", "p1.pub"]  # fmt: skip
    for folder in ["ca", "broker", "monitor", "enrolled", "peers/p1", "peers/p1/enrolled", "peers/p3"]:
        assert stat.S_IMODE((out / folder).stat().st_mode) == 0o700, folder
        for path in (out / folder).iterdir():
            assert path.is_dir() or stat.S_IMODE(path.stat().st_mode) == 0o600, path
    cert = x509.load_pem_x509_certificate((p1 / "p1.crt").read_bytes())
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "p1"
    config = toml.loads((p1 / "agent.toml").read_text())
    assert config["federation"] == {"mode": "peer"}
    assert config["keys"] == {"identity": "p1.key", "enrolled": "enrolled"}
    assert config["agent"]["id"] == "p1" and config["broker"]["tls"]["certfile"] == "p1.crt"
    assert "# model = " in (p1 / "agent.toml").read_text()  # the round plan the operator fills in
    for name in ("p1", "p2", "p3"):
        assert enrolled(out / "peers" / name / "enrolled") == (["p1", "p2", "p3"], [])
    p2_pub = PublicIdentity.load(out / "peers" / "p2" / "p2.pub")
    assert PublicIdentity.load(p1 / "enrolled" / "p2.pub").raw() == p2_pub.raw()
    acl = (out / "broker" / "skyfed.acl").read_text()
    assert "user server" not in acl and f"user p2\ntopic write {PEERS}/p2/#\n" in acl

    before = {p.relative_to(p1): p.read_bytes() for p in p1.rglob("*") if p.is_file()}
    mtimes = {p.name: p.stat().st_mtime_ns for p in (p1 / "enrolled").iterdir()}
    assert provision(out, "p1,p2,p3,p4") == 0  # --mode peer again
    assert provision(out, "p1,p2,p3,p4,p5", mode=()) == 0  # or as the folder was made
    assert {p.relative_to(p1): p.read_bytes() for p in p1.rglob("*") if p.is_file() and "p4" not in p.name
            and "p5" not in p.name} == before  # fmt: skip
    assert {p.name: p.stat().st_mtime_ns for p in (p1 / "enrolled").iterdir() if p.name in mtimes} == mtimes
    for name in ("p1", "p4", "p5"):
        assert enrolled(out / "peers" / name / "enrolled") == (["p1", "p2", "p3", "p4", "p5"], [])
    assert "user p5" in (out / "broker" / "skyfed.acl").read_text()
    assert json.loads((out / "provision.json").read_text())["mode"] == "peer"


def test_one_folder_holds_one_mode(workdir, capsys):
    client, peer = workdir / "client", workdir / "peer"
    assert provision(client, "a1", mode=("--mode", "client")) == 0
    assert provision(client, "a1,p2") == 2
    assert "was provisioned with --mode client, not peer" in capsys.readouterr().err
    assert provision(peer, "p1") == 0
    assert provision(peer, "p1,a2", mode=("--mode", "client")) == 2
    assert "was provisioned with --mode peer, not client: one folder holds one mode" in capsys.readouterr().err
    assert not (peer / "server").exists() and not (client / "peers").exists()


def test_revoking_a_peer_on_disk_and_a_revoked_id_is_never_provisioned_again(workdir, capsys):
    out = workdir / "fed"
    assert provision(out, "p1,p2,p3") == 0
    serial = x509.load_pem_x509_certificate((out / "peers" / "p3" / "p3.crt").read_bytes()).serial_number
    shutil.rmtree(out / "peers" / "p2")  # installed on its device: its key is changed there (keys revoke)
    assert main(["provision", "revoke", "p3", "--out", str(out)]) == 0
    assert "skyfed keys revoke p3 --enrolled /etc/skyfed/enrolled" in capsys.readouterr().out
    assert enrolled(out / "enrolled") == enrolled(out / "peers" / "p1" / "enrolled") == (["p1", "p2"], ["p3"])
    crl = x509.load_pem_x509_crl((out / "broker" / "crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(serial) is not None
    assert "p3" not in (out / "broker" / "skyfed.acl").read_text()
    assert main(["provision", "revoke", "p3", "--out", str(out)]) == 2
    assert "already revoked" in capsys.readouterr().err
    assert provision(out, "p1,p2,p3") == 2
    assert "p3 was revoked" in capsys.readouterr().err
    assert provision(out, "p1,p2,p4") == 0  # a newcomer knows p3 as revoked, not as a stranger
    assert enrolled(out / "peers" / "p4" / "enrolled") == (["p1", "p2", "p4"], ["p3"])


# --- a real broker from the generated files ------------------------------------------------------------
def test_the_generated_acl_confines_each_peer_to_its_own_topics_and_revocation_shuts_it_out(peer_broker):
    out, broker, port = peer_broker
    peers = out / "peers"
    observer = Client(out / "observer", "observer", port, f"{PEERS}/#")
    p1 = Client(peers / "p1", "p1", port)
    p2 = Client(peers / "p2", "p2", port, f"{PEERS}/+/member", f"{PEERS}/+/to/p2")
    p3 = Client(peers / "p3", "p3", port, f"{PEERS}/+/member", f"{PEERS}/+/to/p3", f"{PEERS}/p1/to/p2", f"{PEERS}/#")
    monitor = Client(out / "monitor", "monitor", port, f"{PEERS}/+/member", f"{PEERS}/+/metrics", f"{PEERS}/#")
    clients = [observer, p1, p2, p3, monitor]
    try:
        p1.publish(f"{PEERS}/p2/member", b"forged membership of p2", retain=True)
        p1.publish(f"{PEERS}/p2/to/p3", b"forged model from p2")
        p1.publish(f"{PEERS}/p3/metrics", b"forged metrics of p3", retain=True)
        monitor.publish(f"{PEERS}/monitor/member", b"monitor as a peer", retain=True)
        p1.publish(f"{PEERS}/p1/member", b"p1 member", retain=True)
        p1.publish(f"{PEERS}/p1/metrics", b"p1 metrics", retain=True)
        p1.publish(f"{PEERS}/p1/to/p2", b"sealed to p2")
        wait_until(lambda: f"{PEERS}/p1/to/p2" in p2.topics(), 5, "p2 receives what p1 sealed to it")
        wait_until(lambda: f"{PEERS}/p1/metrics" in monitor.topics(), 5, "the monitor sees p1's metrics")
        wait_until(lambda: len(observer.received) >= 3, 5, "the observer sees p1's own topics")
        time.sleep(0.5)  # a forged message, were it forwarded, would have arrived by now
        assert sorted(observer.topics()) == [f"{PEERS}/p1/member", f"{PEERS}/p1/metrics", f"{PEERS}/p1/to/p2"]
        assert p2.topics() == {f"{PEERS}/p1/member", f"{PEERS}/p1/to/p2"}
        # subscribed to peer/p1/to/p2 and peer/#, p3 gets nothing sealed to p2 (mosquitto grants the
        # subscription and filters each message by the ACL)
        assert p3.topics() == {f"{PEERS}/p1/member", f"{PEERS}/p1/metrics"}
        assert monitor.topics() == {f"{PEERS}/p1/member", f"{PEERS}/p1/metrics"}
        p3.close()

        assert main(["provision", "revoke", "p3", "--out", str(out)]) == 0
        add_observer(out)  # revoke rewrote the ACL
        broker.reload()
        for name in ("p1", "p2"):
            assert enrolled(peers / name / "enrolled") == (["p1", "p2"], ["p3"])
        wait_until(lambda: not connects(node_tls(peers / "p3", "p3"), port), 10, "the broker refuses p3 (CRL)")
        p2.close()
        assert connects(node_tls(peers / "p2", "p2"), port)  # the others still get in
    finally:
        for client in clients:
            client.close()


def test_the_deploy_example_acl_is_what_provision_writes():
    root = Path(__file__).resolve().parent.parent
    assert (root / "deploy/mosquitto/peer.acl").read_text() == peer_acl_text("fleet", ["drone-01", "drone-02"])


def test_provisioned_peers_run_over_tls_and_drop_a_revoked_peer(peer_broker):
    """The provisioned files are all a peer daemon needs besides its data and the round plan, and the ACL
    lets it do its whole round. Needs the peer daemon (``agent.peer``): skipped without it."""
    pytest.importorskip("agent.peer.node")
    from agent.config import load_agent_config
    from agent.peer.node import PeerNode
    from agent.peer.rounds import read_metrics
    from agent.runner import in_process_runner
    from sim.federation import write_classify_data
    from tests.fedharness import override_toml

    out, broker, _port = peer_broker
    names = ["p1", "p2", "p3"]
    write_classify_data(out.parent / "state", names, "iid", seed=0)  # where the provisioned configs expect it
    plan = {"model": "digits_cnn", "rounds": 2, "threshold": 3, "round_timeout_s": 30.0, "join_wait_s": 1.0,
            "strategy": {"name": "fedavg"}, "bounds": {"clip": "off", "sample_multiple": 0}}  # fmt: skip
    nodes = {}
    for name in names:
        path = out / "peers" / name / "agent.toml"
        override_toml(path, federation=plan, training={"threads": 1})
        config = load_agent_config(path)
        nodes[name] = PeerNode(config, runner=in_process_runner(config))
    stop = threading.Event()
    threads = [threading.Thread(target=node.run, args=(stop,), daemon=True) for node in nodes.values()]
    for thread in threads:
        thread.start()
    firsts: dict[str, dict] = {}

    def round_one_everywhere() -> bool:
        for name, node in nodes.items():
            firsts.update((name, line) for line in read_metrics(node.config.state_dir) if line["round"] == 1)
        return len(firsts) == len(names)

    try:
        wait_until(round_one_everywhere, 120, "round 1 on every peer")
        assert all(sorted(line["aggregated_from"]) == names for line in firsts.values()), firsts
        assert main(["provision", "revoke", "p3", "--out", str(out)]) == 0
        add_observer(out)
        broker.reload()
        wait_until(lambda: "p3" not in nodes["p1"].roster.keyring and "p3" not in nodes["p2"].roster.keyring, 5,
                   "p1 and p2 drop p3")  # fmt: skip
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
