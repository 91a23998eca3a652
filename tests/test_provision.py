"""``skyfed provision``: the generated files run a real mosquitto and a real federation as written.

The broker is started from the generated ``skyfed.conf`` itself. Run as root (as CI does), mosquitto
drops to the ``mosquitto`` user before loading its certificates, so these tests also prove the
generated owners and modes; the provisioning folder lives in a world-traversable temporary folder for
that reason (pytest's own ``tmp_path`` is private to root).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from cryptography import x509

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from protocol.mqtt import TlsSettings
from provisioning.broker_files import acl_text, mosquitto_conf_text
from security.envelope import InvalidEnvelope, Opener
from security.keys import GroupKey, Identity, Keyring, PublicIdentity
from sim.federation import write_classify_data
from skyfed import main
from tests.fedharness import hosted_agent, override_toml, wait_until
from tests.liveharness import provision
from tests.tlsharness import Client, add_observer, connects

ROOT = Path(__file__).resolve().parent.parent
FED = "fleet"


def test_layout_modes_and_adding_an_agent_keeps_the_others(workdir, capsys):
    out = workdir / "fed"
    provision(out, "a1,a2", 8883, workdir / "state")
    a1_files = {p.name: p.read_bytes() for p in (out / "agents" / "a1").iterdir()}
    for folder in ["ca", "broker", "server", "server/enrolled", "monitor", "agents/a1", "agents/a2"]:
        assert stat.S_IMODE((out / folder).stat().st_mode) == 0o700, folder
        for path in (out / folder).iterdir():
            assert path.is_dir() or stat.S_IMODE(path.stat().st_mode) == 0o600, path
    if os.geteuid() == 0 and shutil.which("mosquitto"):
        import pwd

        assert (out / "broker" / "broker.crt.key").stat().st_uid == pwd.getpwnam("mosquitto").pw_uid
    assert "skyfed monitor --broker 127.0.0.1:8883 --federation fleet --cafile" in capsys.readouterr().out

    provision(out, "a1,a2,a3", 8883, workdir / "state")
    assert {p.name: p.read_bytes() for p in (out / "agents" / "a1").iterdir()} == a1_files
    assert sorted(p.stem for p in (out / "server" / "enrolled").glob("*.pub")) == ["a1", "a2", "a3"]
    assert "user a3" in (out / "broker" / "skyfed.acl").read_text()
    assert "new: a3" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--agents", "a1,monitor"], "reserved"),
        (["--agents", "a1,a1"], "listed twice"),
        (["--agents", "bad/id"], "--agents"),
        (["--agents", "a1", "--broker", "nohostport"], "--broker"),
        (["--agents", "a1", "--federation", "+"], "--federation '+' is not a valid name"),
        (["--agents", "a1", "--state-dir", "/srv/skyfed"], "--state-dir /srv/skyfed is outside /var/lib/skyfed"),
        (["--agents", "a1", "--state-dir", "/var/lib/skyfed/../x"], "install-server.sh and install-agent.sh refuse"),
        (["--agents", "a1", "--state-dir", "state"], "or add --any-state-dir for daemons you start yourself"),
    ],
)
def test_bad_requests_are_refused_with_the_option_named(workdir, capsys, argv, message):
    assert main(["provision", "--federation", FED, "--out", str(workdir / "fed"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_second_run_must_agree_with_the_first(workdir, capsys):
    out = workdir / "fed"
    provision(out, "a1", 8883, workdir / "state")
    assert main(["provision", "--federation", "other", "--agents", "a1", "--out", str(out)]) == 2
    assert "provisions federation 'fleet'" in capsys.readouterr().err
    assert main(["provision", "--federation", FED, "--agents", "a1", "--out", str(out), "--broker", "h:1"]) == 2
    assert "--broker 127.0.0.1:8883" in capsys.readouterr().err
    assert main(["provision", "revoke", "a1", "--out", str(out)]) == 0
    assert main(["provision", "--federation", FED, "--agents", "a1", "--out", str(out)]) == 2
    assert "a1 was revoked" in capsys.readouterr().err


def test_revoking_an_agent_whose_folder_went_to_its_device_uses_the_recorded_serial(workdir, capsys):
    out = workdir / "fed"
    provision(out, "a1,a2", 8883, workdir / "state")
    serial = x509.load_pem_x509_certificate((out / "agents" / "a1" / "a1.crt").read_bytes()).serial_number
    shutil.rmtree(out / "agents" / "a1")  # copied to the drone, deleted here
    assert main(["provision", "revoke", "a1", "--out", str(out)]) == 0
    crl = x509.load_pem_x509_crl((out / "broker" / "crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(serial) is not None
    plan = json.loads((out / "provision.json").read_text())
    del plan["serials"]["a2"]  # as in a folder provisioned before serials were recorded
    (out / "provision.json").write_text(json.dumps(plan))
    shutil.rmtree(out / "agents" / "a2")
    assert main(["provision", "revoke", "a2", "--out", str(out)]) == 2
    assert "copy the agent's a2.crt back to" in capsys.readouterr().err


def test_the_deploy_examples_are_what_provision_writes():
    assert (ROOT / "deploy/mosquitto/skyfed.acl").read_text() == acl_text("fleet", ["drone-01", "drone-02"])
    expected = mosquitto_conf_text(8883, "", Path("/etc/mosquitto/skyfed"))
    assert (ROOT / "deploy/mosquitto/skyfed.conf").read_text() == expected


# --- a real broker from the generated files ------------------------------------------------------------
def test_the_generated_acl_confines_agents_and_monitors(provisioned):
    out, _, broker, port = provisioned
    assert not connects(TlsSettings(str(out / "monitor" / "ca.crt")), port)
    agents = out / "agents"
    server, a1, a2 = Client(out / "server", "server", port), Client(agents / "a1", "a1", port), Client(
        agents / "a2", "a2", port)  # fmt: skip
    monitor = Client(out / "monitor", "monitor", port)
    try:
        server.subscribe(f"skyfed/{FED}/#")
        a1.subscribe(f"skyfed/{FED}/agent/a2/inbox")
        a1.subscribe(f"skyfed/{FED}/agent/a1/inbox")
        for topic in (f"skyfed/{FED}/server/status", f"skyfed/{FED}/agent/+/status"):
            monitor.subscribe(topic)
        a1.publish(f"skyfed/{FED}/agent/a2/update", b"forged")
        a1.publish(f"skyfed/{FED}/agent/a1/update", b"own")
        a2.publish(f"skyfed/{FED}/agent/a2/status", b"a2 status", retain=True)
        monitor.publish(f"skyfed/{FED}/server/status", b"monitor forged status", retain=True)
        monitor.publish(f"skyfed/{FED}/agent/monitor/status", b"monitor as agent", retain=True)
        server.publish(f"skyfed/{FED}/agent/a2/inbox", b"for a2")
        server.publish(f"skyfed/{FED}/agent/a1/inbox", b"for a1")
        server.publish(f"skyfed/{FED}/server/status", b"server status", retain=True)
        wait_until(lambda: f"skyfed/{FED}/agent/a1/update" in server.topics(), 5, "a1's own update")
        wait_until(lambda: f"skyfed/{FED}/agent/a1/inbox" in a1.topics(), 5, "a1's own inbox")
        wait_until(lambda: len(monitor.received) >= 2, 5, "status seen by the monitor")
        time.sleep(0.5)
        assert f"skyfed/{FED}/agent/a2/update" not in server.topics()
        assert f"skyfed/{FED}/agent/a2/inbox" not in a1.topics()
        assert {p for t, p in server.received if "monitor" in p.decode(errors="replace")} == set()
        assert sorted(p for _, p in monitor.received) == [b"a2 status", b"server status"]
        monitor.close()  # one connection per certificate: the client id is its name
        # a1 choosing the server's client id takes over nothing: the broker uses the certificate name
        disconnects: list[int] = []
        server.client.on_disconnect = lambda *_args: disconnects.append(1)
        hijack = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="server")
        hijack.tls_set(ca_certs=str(agents / "a1" / "ca.crt"), certfile=str(agents / "a1" / "a1.crt"),
                       keyfile=str(agents / "a1" / "a1.crt.key"))  # fmt: skip
        hijack.connect("127.0.0.1", port)
        hijack.loop_start()
        time.sleep(1.0)
        hijack.disconnect()
        hijack.loop_stop()
        assert not disconnects and server.client.is_connected()

        if shutil.which("mosquitto_sub"):  # what an operator types, from the printed instructions
            mon = out / "monitor"
            watched = subprocess.run(
                ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "--cafile", str(mon / "ca.crt"),
                 "--cert", str(mon / "monitor.crt"), "--key", str(mon / "monitor.crt.key"),
                 "-t", f"skyfed/{FED}/server/status", "-t", f"skyfed/{FED}/agent/+/status", "-v", "-W", "2"],
                capture_output=True, text=True, timeout=20,
            )  # fmt: skip
            assert f"skyfed/{FED}/server/status server status" in watched.stdout
            assert f"skyfed/{FED}/agent/a2/status a2 status" in watched.stdout
    finally:
        for client in (server, a1, a2):
            client.close()


def _fast(out: Path, state: Path) -> None:
    """Operator edits for a quick test run: data where the configs expect it, short rounds."""
    names = ["a1", "a2", "a3"]
    write_classify_data(state, names, "iid", seed=0)
    override_toml(
        out / "server" / "server.toml",
        server={"rounds": 5, "eval_data": str(state / "server" / "test.npz"), "status_interval_s": 1.0},
        rounds={"min_agents": 2, "quorum": 2, "deadline_s": 8.0, "status_timeout_s": 10.0},
        strategy={"name": "fedavg"},
        training={"epochs": 1},
    )
    for name in names:
        override_toml(out / "agents" / name / "agent.toml", agent={"status_interval_s": 1.0}, training={"threads": 1})


def test_a_federation_runs_and_a_revoked_agent_reads_no_later_model(provisioned):
    """A round with all three agents; then a3 is revoked (skyfed provision revoke, broker reloaded); the
    server rotates the group key without a restart and the last rounds run with a1 and a2. An eavesdropper with
    the broker's view of every message, holding a3's private keys and every group key a3 ever had,
    opens none of the models published after the revocation, nor any group key sent since."""
    out, state, broker, port = provisioned
    _fast(out, state)
    observer = Client(out / "observer", "observer", port)  # the broker's view: every message
    observer.client.subscribe(f"skyfed/{FED}/#", 1)
    server = Aggregator(load_server_config(out / "server" / "server.toml"))
    agents = {name: hosted_agent(out / "agents" / name / "agent.toml") for name in ("a1", "a2", "a3")}
    stop = threading.Event()
    threads = [threading.Thread(target=agent.run, args=(stop,), daemon=True) for agent in agents.values()]
    server_thread = threading.Thread(target=server.run, daemon=True)
    for thread in [*threads, server_thread]:
        thread.start()
    try:
        metrics = state / "server" / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and '"a3"' in metrics.read_text(), 90, "a round with a3 closed")
        old_key = server.group_keys.key.key_id
        assert main(["provision", "revoke", "a3", "--out", str(out)]) == 0
        add_observer(out)  # revoke rewrote the ACL
        broker.reload()
        wait_until(lambda: server.group_keys.key.key_id != old_key, 10, "the group key rotated")
        rotated_at_version, rotated_at = server.engine.version, len(observer.received)
        server_thread.join(90)
        assert not server_thread.is_alive(), "the federation did not finish"
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        observer.close()

    rows = [json.loads(line) for line in (state / "server" / "metrics.jsonl").read_text().splitlines()]
    assert any("a3" in r["accepted"] for r in rows[:3])  # a3 took part before its revocation (rounds 1-3)
    assert sorted(rows[-1]["accepted"]) == ["a1", "a2"]  # and the federation goes on without it
    new_key = server.group_keys.key.key_id
    assert new_key != old_key and new_key in agents["a1"].group_keys and new_key not in agents["a3"].group_keys

    a3_keys: dict[str, GroupKey] = dict(agents["a3"].group_keys)
    asked: list[str] = []

    def a3_group_key(key_id: str) -> GroupKey | None:
        asked.append(key_id)
        return a3_keys.get(key_id)

    server_pub = PublicIdentity.load(out / "server" / "server.pub")
    eavesdropper = Opener(
        identity=Identity.load(out / "agents" / "a3" / "a3.key"),
        federation=FED,
        senders=Keyring([server_pub]),
        group_keys=a3_group_key,
    )
    outcomes: dict[str, set[str]] = {"model": set(), "groupkey": set()}
    for topic, payload in observer.received:
        parts = topic.split("/")  # skyfed/<fed>/model/<version>/<index> or skyfed/<fed>/agent/<id>/inbox
        later_model = parts[2] == "model" and int(parts[3]) > rotated_at_version
        others_inbox = parts[2] == "agent" and parts[-1] == "inbox" and parts[3] != "a3"
        if not payload or not (later_model or others_inbox):
            continue
        kind = "model" if later_model else "groupkey"
        try:
            eavesdropper.open_chunk(payload)
            outcomes[kind].add("opened")
        except InvalidEnvelope as exc:
            outcomes[kind].add(exc.reason)
    assert new_key in asked, "no model under the new key was published after the revocation"
    assert outcomes["model"] <= {"unknown-key"} and outcomes["model"], outcomes
    assert outcomes["groupkey"] <= {"wrong-recipient"} and outcomes["groupkey"], outcomes
    assert not any(topic.endswith("/a3/inbox") for topic, _ in observer.received[rotated_at:])
    assert (f"skyfed/{FED}/agent/a3/status", b"") in observer.received  # cleared: monitors stop listing a3
    a3 = out / "agents" / "a3"  # and the reloaded broker no longer lets a3 in (its certificate is in the CRL)
    assert not connects(TlsSettings(str(a3 / "ca.crt"), str(a3 / "a3.crt"), str(a3 / "a3.crt.key")), port)
