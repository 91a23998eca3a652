"""``skyfed provision [--mode client|peer] --federation F --agents a1,a2 --out DIR`` and ``skyfed provision
revoke AGENT --out DIR`` (either mode: the folder's plan says which)."""

from __future__ import annotations

import argparse
import posixpath
import sys
from functools import partial
from pathlib import Path

from common import toml
from protocol.mqtt import BrokerSettings
from provisioning.notes import (
    checkout_warning,
    dashboard_instructions,
    defaults_notes,
    eval_data_note,
    next_steps,
    peer_instructions,
    peer_next_steps,
    peer_revoke_text,
)
from provisioning.peer import provision_peers, revoke_peer
from provisioning.provision import (
    MODES,
    MONITOR_SUB,
    Layout,
    ProvisionError,
    Provisioning,
    load_plan,
    ownership_notes,
    provision,
    revoke_agent,
)
from provisioning.region import attach_upstream

DEFAULTS = {"broker": "broker.local:8883", "state_dir": "/var/lib/skyfed", "service_user": "skyfed",
            "broker_user": "mosquitto", "listen": ""}  # fmt: skip


def check_installable_state_dir(state_dir: str) -> None:
    """deploy/install-common.sh's rule (check_state_dir), checked before any file is written: the units may
    write only in /var/lib/skyfed (StateDirectory=skyfed, ProtectSystem=strict)."""
    root = DEFAULTS["state_dir"]
    normal = posixpath.normpath(state_dir)
    if normal != root and not normal.startswith(f"{root}/"):
        raise ProvisionError(
            f"--state-dir {state_dir} is outside {root}, which deploy/install-server.sh and install-agent.sh refuse "
            f"(the units may write only there): give --state-dir {root} or a folder in it, or add --any-state-dir "
            "for daemons you start yourself"
        )


def _plan(args: argparse.Namespace, out: Path) -> Provisioning:
    """The stored plan when ``out`` was provisioned before (options given again must agree), else a new one."""
    given = {key: getattr(args, key) for key in DEFAULTS if getattr(args, key) is not None}
    if Layout(out).plan.exists():
        plan = load_plan(out)
        stored = plan.options()
        if args.mode is not None and args.mode != plan.mode:
            raise ProvisionError(
                f"{out} was provisioned with --mode {plan.mode}, not {args.mode}: one folder holds one mode (its "
                f"own CA, ACL and nodes); provision the {args.mode} federation into a new --out"
            )
        if plan.federation != args.federation:
            raise ProvisionError(f"{out} provisions federation {plan.federation!r}, not {args.federation!r}")
        for key, value in given.items():
            if value != stored[key]:
                raise ProvisionError(f"{out} was provisioned with --{key.replace('_', '-')} {stored[key]}, not {value}")
        if args.broker_dir is not None and args.broker_dir != plan.broker_dir:
            raise ProvisionError(f"{out} was provisioned with --broker-dir {plan.broker_dir}, not {args.broker_dir}")
        return plan
    settings = {**DEFAULTS, **given}
    if not args.any_state_dir:
        check_installable_state_dir(str(settings["state_dir"]))
    try:
        broker = BrokerSettings.from_address(str(settings["broker"]))
    except ValueError as exc:
        raise ProvisionError(f"--broker: {exc}") from None
    if broker.fallbacks:  # provision writes mosquitto's files and one address: never drop the others silently
        raise ProvisionError("--broker: give one HOST:PORT; for a NATS cluster add the other nodes to each config's "
                             "[broker] fallbacks (deploy/nats/README.md)")  # fmt: skip
    return Provisioning(
        federation=args.federation,
        broker_host=broker.host,
        broker_port=broker.port,
        broker_dir=str(Path(args.broker_dir or out / "broker").absolute()),
        state_dir=str(settings["state_dir"]),
        listen=str(settings["listen"]),
        service_user=str(settings["service_user"]),
        broker_user=str(settings["broker_user"]),
        mode=args.mode or "client",
    )


def instructions(out: Path, plan: Provisioning) -> str:
    """How to install and watch what was written (also kept as DIR/README.txt)."""
    f, mon = plan.federation, (out / "monitor").absolute()
    tls, sub = (f"--cafile {mon}/ca.crt --cert {mon}/{name}.crt --key {mon}/{name}.crt.key" for name in
                ("monitor", MONITOR_SUB))  # fmt: skip
    where = f"{plan.broker_host}:{plan.broker_port}"
    topics = f"-t skyfed/{f}/server/status -t skyfed/{f}/server/metrics -t 'skyfed/{f}/agent/+/status'"
    return "\n".join(
        [
            f"SkyFed federation {f!r}: broker {where}",
            f"  broker host: install {out}/broker as {plan.broker_dir} (cp -a keeps owners and modes),",
            f"    ln -s {plan.broker_dir}/skyfed.conf /etc/mosquitto/conf.d/skyfed.conf; systemctl restart mosquitto",
            f"  server:      install {out}/server/* in /etc/skyfed/;"
            " skyfed server run --config /etc/skyfed/server.toml",
            f"  each agent:  install {out}/agents/<id>/* in /etc/skyfed/ on the device; its data goes to "
            f"{plan.state_dir}/<id>/data.npz",
            f"  monitor:     skyfed monitor --broker {where} --federation {f} {tls}",
            f"               mosquitto_sub -h {plan.broker_host} -p {plan.broker_port} {sub} {topics} -v",
            "               (one connection per certificate: a second watcher with the same one evicts the first)",
            *dashboard_instructions(out, plan),
            f"  add agents:  skyfed provision --federation {f} --agents <all ids> --out {out} (existing keys stay)",
            f"  revoke:      skyfed provision revoke <id> --out {out}",
            f"  keep {out}/ca/ca.crt.key offline: it signs every certificate of the federation",
            *region_instructions(out, plan),
        ]
    )


def region_instructions(out: Path, plan: Provisioning) -> list[str]:
    """A region (``--upstream``): how its broker joins the root's."""
    if not plan.upstream:
        return []
    return [f"  region:      {plan.upstream.replace('@', ' of root federation ')}; the server takes part in the "
            "root's rounds ([upstream] in server.toml)",  # fmt: skip
            f"    bridge: ln -s {plan.broker_dir}/bridge.conf /etc/mosquitto/conf.d/skyfed-bridge.conf; "
            "systemctl restart mosquitto (bridges are not re-read on reload)"]  # fmt: skip


def run_provision(args: argparse.Namespace) -> int:
    if not args.out:
        print("skyfed provision: --out DIR is required (the provisioning folder)", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        if args.action == "revoke":
            if load_plan(out).mode == "peer":
                serial = revoke_peer(out, args.agent)
                print(peer_revoke_text(out, load_plan(out), args.agent, serial))
                return 0
            serial = revoke_agent(out, args.agent)
            layout, plan = Layout(out), load_plan(out)
            installed = Path(plan.broker_dir)
            copy = "" if installed == layout.broker.absolute() else (
                f"cp -p {layout.broker}/crl.pem {layout.broker}/skyfed.acl {installed}/; ")  # fmt: skip
            print(
                f"revoked {args.agent}: its key moved to {layout.enrolled}/revoked/, its certificate "
                f"(serial {serial:x}) is in {layout.broker}/crl.pem and the ACL no longer names it\n"
                f"  broker: {copy}systemctl reload mosquitto (new connections check the CRL; the ACL applies at once)\n"
                f"  server: rotates the group key as soon as it sees enrolled/{args.agent}.pub gone (no restart); "
                f"on another host run there: skyfed keys revoke {args.agent} --enrolled /etc/skyfed/enrolled"
            )
            return 0
        if not args.federation or not args.agents:
            raise ProvisionError("skyfed provision needs --federation F and --agents a1,a2,... (and --out DIR)")
        fresh = not Layout(out).plan.exists()
        plan = _plan(args, out)
        peer = plan.mode == "peer"
        agents = [a for a in args.agents.split(",") if a]
        if args.upstream and peer:
            raise ProvisionError("--upstream makes a region's server a participant of a root: peers have no server")
        if args.ws_port is not None:  # may be added to (or changed in) a folder provisioned before
            if not 0 < args.ws_port < 65536:
                raise ProvisionError("--ws-port: a port 1-65535 for the dashboard's WebSockets listener")
            plan.ws_port = args.ws_port
        region = partial(attach_upstream, folder=Path(args.upstream)) if args.upstream else None
        new = provision_peers(out, plan, agents) if peer else provision(out, plan, agents, region)
    except ProvisionError as exc:
        print(f"skyfed provision: {exc}", file=sys.stderr)
        return 2
    text = peer_instructions(out, plan) if peer else instructions(out, plan)
    (out / "README.txt").write_text(text + "\n")
    nodes = "peers" if peer else "agents"
    revoked = plan.revoked_names()
    active = [a for a in plan.agents if a not in revoked]
    gone = f"; {len(revoked)} revoked" if revoked else ""
    print(f"provisioned {len(active)} {nodes} in {out} ({len(new)} new: {', '.join(new) or 'none'}{gone})\n{text}")
    for line in peer_next_steps(out, plan, new) if peer else next_steps(out, plan, new, fresh):
        print(line)
    notes = ownership_notes(plan)
    if fresh:
        given = {"broker_given": args.broker is not None, "broker_dir_given": args.broker_dir is not None}
        notes += defaults_notes(plan, **given)
    if not peer and "eval_data" not in toml.loads((Layout(out).server / "server.toml").read_text()).get("server", {}):
        notes.append(eval_data_note(plan))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if warning := checkout_warning(out):
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def add_provision_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "provision",
        help="CA, certificates, keys, enrolment, mosquitto config and ACL for a whole federation",
        description="Writes one folder per node (broker, server, monitor, each agent) under --out; with --mode peer "
        "no server: broker, monitor, each peer with the enrolled keys of all. Run it again with more agents to add "
        "them; existing keys are kept. `skyfed provision revoke AGENT --out DIR` revokes.",
    )
    parser.add_argument("--mode", choices=MODES, help="client: agents of a server (default for a new folder); peer: "
                        "peers federating with no server (agent.toml [federation] mode = \"peer\")")  # fmt: skip
    parser.add_argument("--federation")
    parser.add_argument("--agents", help="comma-separated agent (or peer) ids (each becomes a certificate CN and MQTT "
                        "user)")  # fmt: skip
    parser.add_argument("--out", help="the provisioning folder (created 0711; every node folder in it 0700)")
    parser.add_argument("--broker", help=f"HOST:PORT clients connect to (default {DEFAULTS['broker']})")
    parser.add_argument("--listen", help="address mosquitto's listener binds (default: every interface)")
    parser.add_argument("--ws-port", type=int, help="add mosquitto's MQTT-over-WebSockets listener (mutual TLS) on "
                        "this port for skyfed dashboard, and the dashboard's read-only certificate")  # fmt: skip
    parser.add_argument("--upstream", metavar="ROOT/agents/REGION", help="a region under a root: the folder the "
                        "root's skyfed provision wrote for this region (provisioned there as one of its --agents); "
                        "adds [upstream] to server.toml and broker/bridge.conf")  # fmt: skip
    parser.add_argument("--broker-dir", help="where the broker folder is installed on the broker host "
                        "(default: DIR/broker itself)")  # fmt: skip
    parser.add_argument("--state-dir", help=f"daemons' state root on their hosts (default {DEFAULTS['state_dir']})")
    parser.add_argument("--any-state-dir", action="store_true", help=f"accept a --state-dir outside "
                        f"{DEFAULTS['state_dir']}, for daemons started by hand (deploy/install-*.sh refuse one)")
    parser.add_argument("--service-user", help="owner of server and agent folders when run as root (default skyfed)")
    parser.add_argument("--broker-user", help="owner of the broker folder when run as root (default mosquitto)")
    parser.set_defaults(handler=run_provision, action=None)
    actions = parser.add_subparsers(dest="action")
    revoke = actions.add_parser("revoke", help="revoke an agent or peer: enrolment, CRL and ACL; the server rotates "
                                "keys, the other peers drop it")  # fmt: skip
    revoke.add_argument("agent")
    revoke.add_argument("--out", required=True, help="the provisioning folder")
