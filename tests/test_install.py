"""deploy/install-agent.sh and install-server.sh, run for real into a scratch root (``--root``).

The provisioning folders come from ``skyfed provision``; the scratch root is a minimal system (passwd,
group, shadow, mosquitto's conf.d and user). To stay fast and offline, the venv is made with
``--torch system --no-deps``: ``--system-site-packages`` and SkyFed alone, its dependencies reaching it
from this interpreter's venv (a .pth the installer writes), so nothing is downloaded and torch is not installed
again.
Everything else is what a device gets: the user and its groups, files, owners and modes, the unit
(enabled with ``systemctl --root``), the mosquitto files, a second run that changes nothing (not even
a timestamp), and an uninstall that keeps or, with ``--purge``, removes config, state and the user.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from agent.config import load_agent_config
from broker_server.config import load_server_config
from protocol.config import read_toml, write_toml
from security.keys import Identity
from skyfed import main

CHECKOUT = Path(__file__).resolve().parent.parent
DEPLOY = CHECKOUT / "deploy"
MOSQUITTO_UID, MOSQUITTO_GID = 4101, 4102  # the scratch root's mosquitto user, unlike any on this host

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the installers create users and chown files: root only"),
    pytest.mark.skipif(shutil.which("useradd") is None, reason="needs useradd (Debian's passwd package)"),
]


# --- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A frozen copy of this checkout's build files and packages: edits to the checkout while the test
    runs cannot change what the second run sees."""
    copy = tmp_path_factory.mktemp("source")
    for name in ("setup.cfg", "pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy2(CHECKOUT / name, copy / name)
    for init in CHECKOUT.glob("*/__init__.py"):
        if init.parent.name not in ("tests", "benchmarks"):
            shutil.copytree(init.parent, copy / init.parent.name, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    build = tmp_path_factory.mktemp("build")
    shutil.copytree(source, build / "src")
    out = build / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
         str(out), str(build / "src")], check=True, capture_output=True,
    )  # fmt: skip
    return next(out.glob("skyfed-*.whl"))


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pki") / "fleet-pki"
    argv = ["provision", "--federation", "fleet", "--agents", "drone-01,drone-02", "--out", str(out),
            "--broker", "broker.example:8883", "--broker-dir", "/etc/mosquitto/skyfed"]  # fmt: skip
    assert main(argv) == 0
    return out


@pytest.fixture
def pki(provisioned, tmp_path) -> Path:
    """This test's own copy of the provisioning folder (tests revoke agents and break files in it)."""
    return Path(shutil.copytree(provisioned, tmp_path / "fleet-pki"))


@pytest.fixture
def root(tmp_path) -> Path:
    """A minimal system: root, the dialout group, mosquitto's user and conf.d, as Debian has them."""
    root = tmp_path / "root"
    (root / "etc" / "mosquitto" / "conf.d").mkdir(parents=True)
    write = {
        "passwd": f"root:x:0:0:root:/root:/bin/bash\nmosquitto:x:{MOSQUITTO_UID}:{MOSQUITTO_GID}::/var/lib/mosquitto:"
        "/usr/sbin/nologin\n",
        "group": f"root:x:0:\ndialout:x:20:\nmosquitto:x:{MOSQUITTO_GID}:\n",
        "shadow": "root:*:19000:0:99999:7:::\nmosquitto:*:19000:0:99999:7:::\n",
        "gshadow": "root:*::\ndialout:*::\nmosquitto:!::\n",
    }
    for name, text in write.items():
        (root / "etc" / name).write_text(text)
    return root


# --- helpers -------------------------------------------------------------------------------------------
def run(script: str, *args: str, root: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """One installer run into ``root``; the --no-deps venv sees this interpreter's packages (the test venv's own:
    the installer names them in a .pth), never a PYTHONPATH."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        ["bash", str(DEPLOY / script), "--root", str(root), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def install(script: str, folder: Path, *args: str, root: Path) -> subprocess.CompletedProcess[str]:
    result = run(script, "--torch", "system", "--no-deps", "--python", sys.executable, *args, str(folder), root=root,
                 cwd=root.parent)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its type, mode, owner, content (or link target) and timestamps."""
    entries: dict[str, tuple] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            content = os.readlink(path)
        elif stat.S_ISREG(info.st_mode):
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            content = ""
        entries[str(path.relative_to(root))] = (info.st_mode, info.st_uid, info.st_gid, content, info.st_mtime_ns,
                                                info.st_ctime_ns)  # fmt: skip
    return entries


def override_toml(path: Path, **tables: dict) -> None:
    data = read_toml(path)
    for name, values in tables.items():
        data.setdefault(name, {}).update(values)
    write_toml(path, data)


def table(path: Path) -> dict[str, list[str]]:
    """passwd or group: name -> fields."""
    return {line.split(":")[0]: line.split(":") for line in path.read_text().splitlines() if line}


def owner_mode(path: Path) -> tuple[int, int, int]:
    info = path.stat()
    return info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)


def venv_of(unit: Path) -> str:
    """The venv the unit runs: its ExecStart is <venv>/bin/skyfed."""
    line = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
    return str(Path(line.split("=", 1)[1].split()[0]).parent.parent)


def enabled(root: Path, unit: str) -> bool:
    return (root / "etc/systemd/system/multi-user.target.wants" / unit).is_symlink()


# --- the agent -----------------------------------------------------------------------------------------
def test_agent_install_places_everything_changes_nothing_twice_and_uninstalls(root, pki, source):
    folder = pki / "agents" / "drone-01"
    (root / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.3\n")  # this root is a Jetson
    initial = snapshot(root)
    first = install("install-agent.sh", folder, "--source", str(source), "--torch", "auto", root=root)
    assert "--torch system (auto on" in first.stdout  # a Jetson trains with JetPack's own PyTorch

    users, groups = table(root / "etc/passwd"), table(root / "etc/group")
    skyfed = users["skyfed"]
    uid, gid = int(skyfed[2]), int(skyfed[3])
    assert uid < 1000 and skyfed[5] == "/var/lib/skyfed" and skyfed[6] == "/usr/sbin/nologin"  # a system user
    assert int(groups["skyfed"][2]) == gid and "skyfed" in groups["dialout"][3].split(",")

    etc = root / "etc/skyfed"
    assert owner_mode(etc) == (0, gid, 0o750)
    for name in ("agent.toml", "server.pub", "ca.crt", "drone-01.crt", "drone-01.pub"):
        assert owner_mode(etc / name) == (0, gid, 0o640), name
        assert (etc / name).read_bytes() == (folder / name).read_bytes(), name
    for name in ("drone-01.key", "drone-01.crt.key"):  # the X25519/Ed25519 identity and the TLS key
        assert owner_mode(etc / name) == (uid, gid, 0o600), name
    assert owner_mode(root / "var/lib/skyfed") == (uid, gid, 0o700)
    assert owner_mode(root / "var/lib/skyfed/drone-01") == (uid, gid, 0o700)  # state_dir, where its data goes
    assert "no data at /var/lib/skyfed/drone-01/data.npz" in first.stdout + first.stderr

    unit = root / "etc/systemd/system/skyfed-agent.service"
    assert unit.read_bytes() == (DEPLOY / "systemd/skyfed-agent.service").read_bytes()
    assert owner_mode(unit) == (0, 0, 0o644)
    if shutil.which("systemctl"):
        assert enabled(root, "skyfed-agent.service")
    drop_in = root / "etc/systemd/system/skyfed-agent.service.d/jetson-gpu.conf"  # the integrated GPU
    assert drop_in.read_bytes() == (DEPLOY / "systemd/jetson-gpu.conf").read_bytes()
    venv = root / venv_of(unit).lstrip("/")
    assert venv.parent == root / "opt/skyfed" and (venv / ".skyfed-install").exists()
    assert (root / "opt/skyfed/README.md").read_text().startswith("# SkyFed")

    # a second run changes nothing: no file, owner, mode or timestamp
    before = snapshot(root)
    second = install("install-agent.sh", folder, "--source", str(source), root=root)
    assert snapshot(root) == before
    assert "up to date" in second.stdout and "installed" not in second.stdout

    # the installed venv runs, SkyFed from its own site-packages, its dependencies from the test venv's, no
    # PYTHONPATH needed (a venv made from a venv's python with --system-site-packages sees only the base's)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([str(venv / "bin/skyfed"), "--help"], capture_output=True, text=True, env=env, cwd="/")
    assert done.returncode == 0 and "provision" in done.stdout, done.stderr
    where = subprocess.run([str(venv / "bin/python"), "-c", "import agent, paho; print(agent.__file__, paho.__file__)"],
                           capture_output=True, text=True, env=env, cwd="/", check=True)  # fmt: skip
    installed, dependency = where.stdout.split()
    assert installed.startswith(str(venv)) and dependency.startswith(sysconfig.get_paths()["purelib"])

    # a config the daemon's loader refuses stops the install before the config is installed
    bad = Path(shutil.copytree(folder, pki / "bad"))
    override_toml(bad / "agent.toml", agent={"colour": "red"})
    refused = run("install-agent.sh", "--torch", "system", "--no-deps", "--python", sys.executable, "--source",
                  str(source), str(bad), root=root, cwd=root.parent)  # fmt: skip
    assert refused.returncode != 0 and "colour" in refused.stderr
    assert snapshot(root) == before

    # an edited config is kept (and named); --force-config puts the provisioned one back
    (etc / "agent.toml").write_text((folder / "agent.toml").read_text() + "# edited on the device\n")
    kept = install("install-agent.sh", folder, "--source", str(source), root=root)
    assert f"kept {etc}/agent.toml" in kept.stderr and "edited" in (etc / "agent.toml").read_text()
    install("install-agent.sh", folder, "--source", str(source), "--force-config", root=root)
    assert (etc / "agent.toml").read_bytes() == (folder / "agent.toml").read_bytes()
    assert owner_mode(etc / "agent.toml") == (0, gid, 0o640)

    # the installed config loads: relative key paths resolve in /etc/skyfed, the keys' modes pass
    data = root / "var/lib/skyfed/drone-01/data.npz"
    override_toml(etc / "agent.toml", agent={"data": str(data), "state_dir": str(data.parent)})
    data.write_bytes(b"")
    config = load_agent_config(etc / "agent.toml")
    assert config.identity_path == etc / "drone-01.key" and config.broker.tls.keyfile == str(etc / "drone-01.crt.key")
    assert Identity.load(config.identity_path).name == "drone-01"  # 0600: the loader refuses a readable key

    # --uninstall: the service and the venv go; config, keys, state and the user stay
    gone = run("install-agent.sh", "--uninstall", root=root, cwd=root.parent)
    assert gone.returncode == 0, gone.stderr
    assert not unit.exists() and not enabled(root, "skyfed-agent.service") and not (root / "opt/skyfed").exists()
    assert not drop_in.parent.exists()
    assert (etc / "drone-01.key").exists() and data.exists() and "skyfed" in table(root / "etc/passwd")
    assert "--purge removes them" in gone.stdout

    # --uninstall --purge: nothing of SkyFed is left
    purged = run("install-agent.sh", "--uninstall", "--purge", root=root, cwd=root.parent)
    assert purged.returncode == 0, purged.stderr
    final = snapshot(root)
    assert not etc.exists() and not (root / "var/lib/skyfed").exists()
    for name in ("passwd", "group", "shadow", "gshadow"):  # the user, its group and its dialout membership
        assert final[f"etc/{name}"][3] == initial[f"etc/{name}"][3], name
    # left: folders the install created as parents, and useradd's backups (passwd- etc.)
    left = {path for path in final if path not in initial}
    assert left <= {"opt", "var", "var/lib", "etc/systemd", "etc/systemd/system", "etc/passwd-", "etc/group-",
                    "etc/shadow-", "etc/gshadow-"}, left  # fmt: skip


def test_a_peer_installs_with_its_enrolled_folder_and_revoked_peers_leave_it(root, source, tmp_path):
    """A folder from ``skyfed provision --mode peer`` (no server.pub; keys.enrolled instead)."""
    pytest.importorskip("agent.peer.plan")  # the installer checks the config with the daemon's own loader
    pki = tmp_path / "peer-pki"
    assert main(["provision", "--mode", "peer", "--federation", "fleet", "--agents", "drone-01,drone-02,drone-03",
                 "--out", str(pki), "--broker", "broker.example:8883"]) == 0  # fmt: skip
    folder = pki / "peers" / "drone-01"
    override_toml(folder / "agent.toml", federation={"model": "digits_cnn", "rounds": 5, "threshold": 3})
    first = install("install-agent.sh", folder, "--source", str(source), root=root)
    etc = root / "etc/skyfed"
    assert sorted(p.name for p in (etc / "enrolled").iterdir()) == ["drone-01.pub", "drone-02.pub", "drone-03.pub"]
    assert not (etc / "server.pub").exists() and "no data at /var/lib/skyfed/drone-01/" in first.stdout + first.stderr

    assert main(["provision", "revoke", "drone-03", "--out", str(pki)]) == 0
    again = install("install-agent.sh", folder, "--source", str(source), root=root)
    assert sorted(p.name for p in (etc / "enrolled").iterdir()) == ["drone-01.pub", "drone-02.pub", "revoked"]
    assert "revoked drone-03" in again.stdout


# --- the server ----------------------------------------------------------------------------------------
def test_server_install_with_the_broker_folder_revocations_and_an_agent_on_the_same_host(root, pki, wheel):
    folder = pki / "server"
    first = install("install-server.sh", folder, "--source", str(wheel), root=root)
    skyfed = table(root / "etc/passwd")["skyfed"]
    uid, gid = int(skyfed[2]), int(skyfed[3])
    assert "skyfed" not in table(root / "etc/group")["dialout"][3]  # only the agent talks to serial ports

    etc = root / "etc/skyfed"
    assert owner_mode(etc / "server.toml") == (0, gid, 0o640)
    assert owner_mode(etc / "server.key") == (uid, gid, 0o600)
    assert owner_mode(etc / "server.crt.key") == (uid, gid, 0o600)
    assert owner_mode(etc / "enrolled") == (0, gid, 0o750)
    assert sorted(p.name for p in (etc / "enrolled").iterdir()) == ["drone-01.pub", "drone-02.pub"]
    assert owner_mode(root / "var/lib/skyfed/server") == (uid, gid, 0o700)
    config = load_server_config(etc / "server.toml")
    assert config.enrolled_dir == etc / "enrolled" and config.identity_path == etc / "server.key"

    broker = root / "etc/mosquitto/skyfed"  # where the provisioned skyfed.conf says its files are
    assert owner_mode(broker) == (MOSQUITTO_UID, MOSQUITTO_GID, 0o700)
    for path in (pki / "broker").iterdir():
        assert (broker / path.name).read_bytes() == path.read_bytes(), path.name
        assert owner_mode(broker / path.name) == (MOSQUITTO_UID, MOSQUITTO_GID, 0o600), path.name
    link = root / "etc/mosquitto/conf.d/skyfed.conf"
    assert os.readlink(link) == "/etc/mosquitto/skyfed/skyfed.conf"
    assert "systemctl restart mosquitto" in first.stdout
    assert "server.eval_data is not set" in first.stderr  # provision writes none: nothing measures accuracy
    unit = root / "etc/systemd/system/skyfed-server.service"
    assert unit.read_bytes() == (DEPLOY / "systemd/skyfed-server.service").read_bytes()
    if shutil.which("systemctl"):
        assert enabled(root, "skyfed-server.service")
    dashboard = root / "etc/systemd/system/skyfed-dashboard.service"  # installed, idle: no WebSockets listener
    assert dashboard.read_bytes() == (DEPLOY / "systemd/skyfed-dashboard.service").read_bytes()
    assert not dashboard.with_suffix(".service.d").exists() and not enabled(root, "skyfed-dashboard.service")
    assert "skyfed-dashboard.service: installed, not enabled" in first.stdout and "--ws-port" in first.stdout

    # revoking an agent in the provisioning folder and installing again takes it out everywhere
    assert main(["provision", "revoke", "drone-02", "--out", str(pki)]) == 0
    again = install("install-server.sh", folder, "--source", str(wheel), root=root)
    assert sorted(p.name for p in (etc / "enrolled").iterdir()) == ["drone-01.pub", "revoked"]
    assert "revoked drone-02" in again.stdout
    assert (broker / "crl.pem").read_bytes() == (pki / "broker/crl.pem").read_bytes()
    assert "user drone-02" not in (broker / "skyfed.acl").read_text()
    assert "systemctl reload mosquitto" in again.stdout  # the ACL and CRL changed, not the listener

    # the agent on the same host shares the venv; --purge is refused while the server still uses it all
    shared = install("install-agent.sh", pki / "agents/drone-01", "--source", str(wheel), root=root)
    assert "up to date" in shared.stdout
    assert not (root / "etc/systemd/system/skyfed-agent.service.d").exists()  # not a Jetson: no GPU drop-in
    before = snapshot(root)
    refused = run("install-agent.sh", "--uninstall", "--purge", root=root, cwd=root.parent)
    assert refused.returncode != 0 and "skyfed-server.service is installed here too" in refused.stderr
    assert snapshot(root) == before

    # plain MQTT instead of TLS: the plain config replaces the link
    plain = install("install-server.sh", folder, "--source", str(wheel), "--mosquitto", "plain", root=root)
    conf_d = root / "etc/mosquitto/conf.d"
    assert sorted(p.name for p in conf_d.iterdir()) == ["skyfed-plain.conf"]
    assert (conf_d / "skyfed-plain.conf").read_bytes() == (DEPLOY / "mosquitto/plain.conf").read_bytes()
    assert "trusted network only" in plain.stderr

    # uninstalling the server keeps the venv the agent still runs; then the agent's purge removes the rest
    gone = run("install-server.sh", "--uninstall", root=root, cwd=root.parent)
    assert gone.returncode == 0, gone.stderr
    assert not unit.exists() and not any(conf_d.iterdir()) and (root / "opt/skyfed").exists()
    assert not dashboard.exists()
    purged = run("install-agent.sh", "--uninstall", "--purge", root=root, cwd=root.parent)
    assert purged.returncode == 0, purged.stderr
    assert not (root / "opt/skyfed").exists() and not etc.exists() and "skyfed" not in table(root / "etc/passwd")


def test_server_install_sets_up_the_dashboard_for_a_broker_with_a_websockets_listener(root, wheel, tmp_path):
    out = tmp_path / "fleet-pki"
    assert main(["provision", "--federation", "fleet", "--agents", "drone-01", "--out", str(out), "--broker",
                 "broker.example:8883", "--broker-dir", "/etc/mosquitto/skyfed", "--ws-port", "8884"]) == 0  # fmt: skip
    done = install("install-server.sh", out / "server", "--source", str(wheel), root=root)
    units = root / "etc/systemd/system"
    shipped = (DEPLOY / "systemd/skyfed-dashboard.service").read_bytes()
    assert (units / "skyfed-dashboard.service").read_bytes() == shipped
    dropin = (units / "skyfed-dashboard.service.d/skyfed.conf").read_text()
    assert "Environment=SKYFED_BROKER=broker.example:8883 SKYFED_WS_PORT=8884 SKYFED_FEDERATION=fleet\n" in dropin
    if shutil.which("systemctl"):
        assert enabled(root, "skyfed-dashboard.service") and "enabled skyfed-dashboard.service" in done.stdout
    before = snapshot(root)
    install("install-server.sh", out / "server", "--source", str(wheel), root=root)
    assert snapshot(root) == before  # a second run changes nothing
    gone = run("install-server.sh", "--uninstall", root=root, cwd=root.parent)
    assert gone.returncode == 0, gone.stderr
    assert not (units / "skyfed-dashboard.service").exists() and not (units / "skyfed-dashboard.service.d").exists()
    assert not enabled(root, "skyfed-dashboard.service")


# --- bad input -----------------------------------------------------------------------------------------
def _missing_key(pki: Path) -> Path:
    (pki / "agents/drone-01/drone-01.key").unlink()
    return pki / "agents/drone-01"


def _missing_server_key(pki: Path) -> Path:
    (pki / "agents/drone-01/server.pub").unlink()
    return pki / "agents/drone-01"


def _relative_state_dir(pki: Path) -> Path:
    override_toml(pki / "agents/drone-01/agent.toml", agent={"state_dir": "state"})
    return pki / "agents/drone-01"


def _missing_tls_key(pki: Path) -> Path:
    (pki / "agents/drone-01/drone-01.crt.key").unlink()
    return pki / "agents/drone-01"


@pytest.mark.parametrize(
    ("script", "make", "args", "code", "message"),
    [
        ("install-agent.sh", lambda pki: pki / "agents/nobody", [], 1, "no such folder"),
        ("install-agent.sh", lambda pki: pki / "server", [], 1, "has no agent.toml"),
        ("install-agent.sh", _missing_key, [], 1, "keys.identity = 'drone-01.key': agent key file not found"),
        ("install-agent.sh", _missing_server_key, [], 1, "keys.server = 'server.pub': server public key not found"),
        ("install-agent.sh", _missing_tls_key, [], 1, "broker.tls.keyfile = 'drone-01.crt.key'"),
        ("install-agent.sh", _relative_state_dir, [], 1, "agent.state_dir = 'state' is outside /var/lib/skyfed"),
        ("install-agent.sh", lambda pki: pki / "agents/drone-01", ["--torch", "gpu"], 2, "--torch must be"),
        ("install-agent.sh", lambda pki: pki / "agents/drone-01", ["--mosquitto", "plain"], 2, "unknown option"),
        ("install-server.sh", lambda pki: pki / "server", ["--mosquitto", str(Path("/nonexistent"))], 1,
         "no skyfed.conf there"),
        ("install-server.sh", lambda pki: pki / "agents/drone-01", [], 1, "has no server.toml"),
    ],
)  # fmt: skip
def test_bad_input_fails_with_a_clear_message_before_changing_anything(root, pki, script, make, args, code, message):
    folder = make(pki)
    before = snapshot(root)
    result = run(script, "--torch", "system", "--no-deps", "--python", sys.executable, *args, str(folder), root=root,
                 cwd=root.parent)  # fmt: skip
    assert result.returncode == code and message in result.stderr, result.stderr
    assert snapshot(root) == before


def test_no_deps_with_an_interpreter_that_lacks_them_stops_before_changing_anything(root, pki, tmp_path):
    """--no-deps takes SkyFed's dependencies from --python's packages: an interpreter without them made a venv whose
    service could not start. A bare venv's python has none."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    before = snapshot(root)
    result = run("install-agent.sh", "--torch", "system", "--no-deps", "--python", str(bare / "bin/python"),
                 str(pki / "agents/drone-01"), root=root, cwd=root.parent)  # fmt: skip
    assert result.returncode == 1 and "cannot import SkyFed's dependencies (cryptography" in result.stderr
    assert snapshot(root) == before


def test_a_server_folder_without_a_broker_folder_asks_which_mosquitto_config(root, pki):
    shutil.rmtree(pki / "broker")
    before = snapshot(root)
    result = run("install-server.sh", "--no-deps", "--python", sys.executable, str(pki / "server"), root=root,
                 cwd=root.parent)  # fmt: skip
    assert result.returncode == 1 and "--mosquitto plain" in result.stderr
    assert snapshot(root) == before


def test_cpu_or_cuda_torch_needs_pinned_constraints(root, pki, tmp_path):
    unpinned = tmp_path / "unpinned.txt"
    unpinned.write_text("numpy==1.26.4\n")
    before = snapshot(root)
    result = run("install-agent.sh", "--torch", "cpu", "--constraints", str(unpinned), str(pki / "agents/drone-01"),
                 root=root, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1 and "pins no torch" in result.stderr, result.stderr
    assert snapshot(root) == before


@pytest.mark.parametrize("script", ["install-agent.sh", "install-server.sh"])
def test_help_names_every_option(script):
    result = subprocess.run(["bash", str(DEPLOY / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in ("--torch", "--torch-index", "--detect", "--constraints", "--source", "--python", "--root",
                   "--no-start", "--force-config", "--no-deps", "--uninstall", "--purge"):  # fmt: skip
        assert option in result.stdout, option
    assert ("--mosquitto" in result.stdout) == (script == "install-server.sh")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_install_scripts_are_shellcheck_clean():
    scripts = sorted(str(p) for p in DEPLOY.glob("install-*.sh"))
    result = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True, cwd=CHECKOUT)
    assert result.returncode == 0, result.stdout
