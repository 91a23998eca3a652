"""``skyfed provision``: every file a federation needs, one folder per node, ready to install.

    DIR/provision.json   what was provisioned (federation, broker, agents, revocations); re-running
                         provision with more agents adds them and leaves every existing key alone
    DIR/ca/              the federation CA (keep ca.crt.key offline: it signs every certificate)
    DIR/broker/          for mosquitto: skyfed.conf (TLS only, client certificates required, certificate
                         CN as user name, ACL, CRL, message size limit), skyfed.acl, crl.pem, ca.crt,
                         broker.crt and its key
    DIR/server/          server.toml, server.key/.pub, server.crt and key, ca.crt, enrolled/<agent>.pub
    DIR/monitor/         monitor.crt and key, ca.crt: read-only access to status and metrics; monitor-sub.crt
                         and key, the same for mosquitto_sub (one connection per certificate)
    DIR/dashboard/       with --ws-port: dashboard.crt and key, ca.crt, and dashboard.p12 (+ .password) for a
                         browser: the same read-only access over the broker's WebSockets listener
    DIR/agents/<id>/     agent.toml, <id>.key/.pub, server.pub, <id>.crt and key, ca.crt

``--mode peer`` (``provisioning.peer``: no server, the peers federate among themselves) writes
``DIR/enrolled/`` (every peer's .pub, ``revoked/`` inside) and ``DIR/peers/<id>/`` instead of the server
and agent folders; one folder holds one mode.

Node files are 0600 in 0700 folders. Run as root, the broker folder goes to the broker's user and the
server and agent folders to the service user (when those users exist): mosquitto 2 drops privileges
before it loads its certificates, so a root-owned key stops it with ``Permission denied``.
Revocation (``revoke_agent``) moves the agent's key to ``server/enrolled/revoked/``, puts its
certificate in the CRL and takes it out of the ACL; the server rotates the group key when it sees it.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.files import atomic_write, read_json, write_json
from protocol.config import write_toml
from protocol.topics import check_level
from protocol.typed import SchemaError, build
from provisioning.broker_files import acl_text, mosquitto_conf_text, peer_acl_text
from security.keys import Identity, PublicIdentity, check_name, enroll, revoke
from security.pki import Issued, create_ca, issue, serial_of, write_crl, write_pkcs12

MONITOR_SUB = "monitor-sub"  # the second monitoring certificate: mosquitto_sub next to skyfed monitor
RESERVED = ("server", "monitor", MONITOR_SUB, "dashboard")  # the certificate CNs (MQTT user names) of the other roles
PLAN = "provision.json"
MODES = ("client", "peer")  # agents of a server, or peers federating among themselves


class ProvisionError(ValueError):
    """Provisioning cannot go on; the message says why and what to do."""


@dataclass(frozen=True)
class Revocation:
    agent: str
    serial: str  # the certificate's serial number, hex (160-bit: JSON numbers would round it)
    at: float  # unix time


@dataclass
class Provisioning:
    """What ``provision.json`` records: the settings of the first run, kept for every later one."""

    federation: str
    broker_host: str
    broker_port: int
    broker_dir: str  # where the broker folder lives on the broker host (absolute; skyfed.conf names it)
    state_dir: str  # the daemons' state root on their hosts: <state_dir>/server, <state_dir>/<agent>
    listen: str = ""  # the address mosquitto's listener binds ("" = every interface)
    service_user: str = "skyfed"
    broker_user: str = "mosquitto"
    agents: list[str] = field(default_factory=list)
    revoked: list[Revocation] = field(default_factory=list)
    serials: dict[str, str] = field(default_factory=dict)  # agent -> its certificate's serial, hex
    mode: str = "client"  # MODES; a folder provisioned before peer mode existed is a client one
    upstream: str = ""  # a region: "<region>@<root federation>" (``provisioning.region``); "" = none
    ws_port: int = 0  # mosquitto's MQTT-over-WebSockets listener for skyfed dashboard (0 = none)

    def options(self) -> dict[str, str]:
        """The command-line options this plan was made with, by option name."""
        return {"broker": f"{self.broker_host}:{self.broker_port}", "state_dir": self.state_dir,
                "listen": self.listen, "service_user": self.service_user, "broker_user": self.broker_user}  # fmt: skip

    def revoked_names(self) -> set[str]:
        return {r.agent for r in self.revoked}


@dataclass(frozen=True)
class Layout:
    out: Path

    @property
    def plan(self) -> Path:
        return self.out / PLAN

    @property
    def ca(self) -> Issued:
        return Issued(self.out / "ca" / "ca.crt", self.out / "ca" / "ca.crt.key")

    @property
    def broker(self) -> Path:
        return self.out / "broker"

    @property
    def server(self) -> Path:
        return self.out / "server"

    @property
    def enrolled(self) -> Path:
        return self.server / "enrolled"

    @property
    def monitor(self) -> Path:
        return self.out / "monitor"

    @property
    def dashboard(self) -> Path:
        return self.out / "dashboard"

    def agent(self, name: str) -> Path:
        return self.out / "agents" / name

    @property
    def peers_enrolled(self) -> Path:
        """Peer mode: every peer's .pub (``revoked/`` inside), copied into each peer's ``enrolled/``."""
        return self.out / "enrolled"

    def peer(self, name: str) -> Path:
        return self.out / "peers" / name

    def node(self, plan: Provisioning, name: str) -> Path:
        """The folder of agent or peer ``name``."""
        return self.peer(name) if plan.mode == "peer" else self.agent(name)


def load_plan(out: Path) -> Provisioning:
    layout = Layout(out)
    if not layout.plan.exists():
        raise ProvisionError(f"{out} holds no {PLAN}: run skyfed provision --federation F --agents ... --out {out}")
    try:
        return build(Provisioning, read_json(layout.plan), where=PLAN, strict=True)
    except (SchemaError, ValueError) as exc:
        raise ProvisionError(f"{layout.plan}: {exc}") from None


def check_agent_names(agents: list[str]) -> list[str]:
    for name in agents:
        try:
            check_name(name)
        except ValueError as exc:
            raise ProvisionError(f"--agents: {exc}") from None
        if name in RESERVED:
            raise ProvisionError(f"--agents: {name!r} is reserved (the {name}'s certificate name); choose another id")
    if len(set(agents)) != len(agents):
        raise ProvisionError("--agents: an agent id is listed twice")
    return agents


def start(out: Path, plan: Provisioning, agents: list[str]) -> Layout:
    """Check the request, then create the folder, the CA and the monitor's certificate (once)."""
    layout = Layout(out)
    try:
        check_level("--federation", plan.federation)  # it becomes a topic level in the ACL
    except ValueError as exc:
        raise ProvisionError(str(exc)) from None
    check_agent_names(agents)
    again = sorted(set(agents) & plan.revoked_names())
    if again:
        raise ProvisionError(
            f"{', '.join(again)} was revoked in {out}: a revoked id is never re-admitted with the same "
            "certificate serial history; provision the device under a new id"
        )
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o711)  # traversable: the broker folder may be used in place; each node folder is 0700
    if not layout.ca.cert.exists():
        create_ca(layout.ca.cert.parent, plan.federation)
    if not (layout.monitor / "monitor.crt").exists():
        certificate(layout, layout.monitor, "monitor")
    if plan.mode != "peer" and not (layout.monitor / f"{MONITOR_SUB}.crt").exists():  # also for older folders
        issue(layout.ca, layout.monitor, MONITOR_SUB)
    if plan.ws_port and not (layout.dashboard / "dashboard.crt").exists():
        dashboard_certificate(layout)
    return layout


def finish(layout: Layout, plan: Provisioning) -> None:
    """The broker's files, the plan and the owners and modes, after every change."""
    if plan.agents:
        os.chmod(layout.node(plan, plan.agents[0]).parent, 0o711)
    _broker_files(layout, plan)
    write_json(layout.plan, asdict(plan), mode=0o600)
    _lock_down(layout, plan)


def provision(out: Path, plan: Provisioning, agents: list[str],
              extend: Callable[[Layout, Provisioning], None] | None = None) -> list[str]:  # fmt: skip
    """Create (or extend) the federation in ``out``; return the agents that are new. ``extend`` adds to it before
    the plan is saved (a region's ``[upstream]``: ``provisioning.region.attach_upstream``)."""
    layout = start(out, plan, agents)
    server = _server_node(layout, plan)
    new = [name for name in agents if name not in plan.agents]
    for name in new:
        _agent_node(layout, plan, name, server)
        plan.agents.append(name)
    if extend is not None:
        extend(layout, plan)
    finish(layout, plan)
    return new


def revocation(layout: Layout, plan: Provisioning, agent: str) -> Revocation:
    """The revocation of ``agent`` (with its certificate's serial), or why it cannot be revoked."""
    out = layout.out
    if agent in plan.revoked_names():
        raise ProvisionError(f"{agent} is already revoked in {out}")
    if agent not in plan.agents:
        raise ProvisionError(f"{agent} was not provisioned in {out} (agents: {', '.join(plan.agents) or 'none'})")
    cert = layout.node(plan, agent) / f"{agent}.crt"
    if agent in plan.serials:  # recorded when issued: the agent's folder may have gone to its device
        serial = int(plan.serials[agent], 16)
    elif cert.exists():  # a folder provisioned before serials were recorded
        serial = serial_of(cert)
    else:
        raise ProvisionError(
            f"{agent}'s certificate serial is not in {layout.plan} and {cert} is gone: copy the agent's "
            f"{agent}.crt back to {cert.parent}/ and run revoke again"
        )
    return Revocation(agent, f"{serial:x}", time.time())


def revoke_agent(out: Path, agent: str) -> int:
    """Stop trusting ``agent`` everywhere the provisioning folder reaches; return its certificate serial."""
    layout = Layout(out)
    plan = load_plan(out)
    plan.revoked.append(revoked := revocation(layout, plan, agent))
    if (layout.enrolled / f"{agent}.pub").exists():
        revoke(layout.enrolled, agent)
    finish(layout, plan)
    return int(revoked.serial, 16)


# nodes -------------------------------------------------------------------------------------------------
def certificate(layout: Layout, directory: Path, name: str) -> None:
    """A client certificate (CN = ``name``) and the CA certificate to check the broker with."""
    issue(layout.ca, directory, name)
    shutil.copyfile(layout.ca.cert, directory / "ca.crt")


def dashboard_certificate(layout: Layout) -> None:
    """The dashboard's client certificate, also as a PKCS#12 file a browser imports (password beside it)."""
    certificate(layout, layout.dashboard, "dashboard")
    password = secrets.token_urlsafe(18)
    atomic_write(layout.dashboard / "dashboard.p12.password", (password + "\n").encode())
    issued = Issued(layout.dashboard / "dashboard.crt", layout.dashboard / "dashboard.crt.key")
    write_pkcs12(issued, layout.ca.cert, layout.dashboard / "dashboard.p12", password.encode())


def tls_settings(name: str) -> dict[str, object]:
    return {"ca_certs": "ca.crt", "certfile": f"{name}.crt", "keyfile": f"{name}.crt.key"}


def _server_node(layout: Layout, plan: Provisioning) -> PublicIdentity:
    directory = layout.server
    if (directory / "server.key").exists():
        return PublicIdentity.load(directory / "server.pub")
    identity = Identity.generate("server")
    identity.save(directory)
    layout.enrolled.mkdir(parents=True, exist_ok=True)
    certificate(layout, directory, "server")
    write_toml(
        directory / "server.toml",
        {
            "server": {"federation": plan.federation, "state_dir": f"{plan.state_dir}/server", "rounds": 0},
            "broker": {"host": plan.broker_host, "port": plan.broker_port, "tls": tls_settings("server")},
            "keys": {"identity": "server.key", "enrolled": "enrolled"},
        },
    )
    return identity.public


def _agent_node(layout: Layout, plan: Provisioning, name: str, server: PublicIdentity) -> None:
    directory = layout.agent(name)
    identity = Identity.generate(name)
    identity.save(directory)
    server.save(directory / "server.pub")
    certificate(layout, directory, name)
    plan.serials[name] = f"{serial_of(directory / f'{name}.crt'):x}"
    state = f"{plan.state_dir}/{name}"
    write_toml(
        directory / "agent.toml",
        {
            "agent": {"id": name, "federation": plan.federation, "state_dir": state, "data": f"{state}/data.npz"},
            "broker": {"host": plan.broker_host, "port": plan.broker_port, "tls": tls_settings(name)},
            "keys": {"identity": f"{name}.key", "server": "server.pub"},
        },
    )
    enroll(layout.enrolled, identity.public)


def _broker_files(layout: Layout, plan: Provisioning) -> None:
    """The broker's certificate (once), and its ACL, CRL and config (derived: rewritten on every run)."""
    directory = layout.broker
    if not (directory / "broker.crt").exists():
        hosts = tuple(dict.fromkeys([plan.broker_host, "localhost", "127.0.0.1"]))
        issue(layout.ca, directory, plan.broker_host, hosts=hosts, stem="broker")
        shutil.copyfile(layout.ca.cert, directory / "ca.crt")
    write_crl(layout.ca, directory / "crl.pem", [(int(r.serial, 16), r.at) for r in plan.revoked])
    active = [name for name in plan.agents if name not in plan.revoked_names()]
    region, _, root_federation = plan.upstream.partition("@")
    upstream = (region, root_federation) if plan.upstream else None
    peer = plan.mode == "peer"
    text = peer_acl_text(plan.federation, active) if peer else acl_text(plan.federation, active, upstream)
    atomic_write(directory / "skyfed.acl", text.encode())
    conf = mosquitto_conf_text(plan.broker_port, plan.listen, Path(plan.broker_dir), plan.ws_port)
    atomic_write(directory / "skyfed.conf", conf.encode())


# owners and modes --------------------------------------------------------------------------------------
def _uid_gid(user: str) -> tuple[int, int] | None:
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


def _own(root: Path, owner: tuple[int, int] | None) -> None:
    """Folders 0700 and files 0600 under ``root``, owned by ``owner`` when given (root only)."""
    for path in [root, *root.rglob("*")]:
        os.chmod(path, 0o700 if path.is_dir() else 0o600)
        if owner is not None:
            os.chown(path, *owner)


def _lock_down(layout: Layout, plan: Provisioning) -> None:
    as_root = os.geteuid() == 0
    _own(layout.ca.cert.parent, None)
    _own(layout.monitor, None)
    if layout.dashboard.exists():
        _own(layout.dashboard, None)
    _own(layout.broker, _uid_gid(plan.broker_user) if as_root else None)
    service = _uid_gid(plan.service_user) if as_root else None
    for folder in (layout.server, layout.peers_enrolled):
        if folder.exists():
            _own(folder, service if folder == layout.server else None)
    for name in plan.agents:
        if layout.node(plan, name).exists():  # an agent's folder may have gone to its device
            _own(layout.node(plan, name), service)


def ownership_notes(plan: Provisioning) -> list[str]:
    """What provisioning could not hand over (run as root, users that do not exist here), and a broker
    folder used in place that the broker's user cannot reach."""
    closed = [p for p in Path(plan.broker_dir).parents if p.exists() and not p.stat().st_mode & 0o001]
    reach = [f"{closed[0]} is not traversable by others: mosquitto (user {plan.broker_user}) cannot reach "
             f"{plan.broker_dir}; install the broker folder elsewhere (--broker-dir)"] if closed else []  # fmt: skip
    if os.geteuid() != 0:
        return reach
    return reach + [
        f"user {user} does not exist on this host: the {what} files stay owned by root; on the host that runs it, "
        f"chown -R {user}: its folder"
        for user, what in ((plan.broker_user, "broker"), (plan.service_user, "server and agent"))
        if _uid_gid(user) is None
    ]
