"""What ``skyfed provision`` tells the operator after writing: the steps that make new agents (or peers) work,
the missing evaluation data, and a provisioning folder (with the CA's private key) inside a git checkout."""

from __future__ import annotations

from pathlib import Path

from provisioning.provision import Layout, Provisioning

ETC = "/etc/skyfed"  # where deploy/install-*.sh install a node's folder


def next_steps(out: Path, plan: Provisioning, new: list[str], fresh: bool = False) -> list[str]:
    """Exact commands, in order, for the agents just added: until the broker reloads its ACL it drops every
    message they send (while they log "mqtt connected"), and until the server holds their keys it ignores them.
    In a folder provisioned just now (``fresh``) the broker and server folders hold them already."""
    if not new:
        return []
    layout = Layout(out)
    installed = Path(plan.broker_dir)
    copy = "" if installed == layout.broker.absolute() else f"cp -p {layout.broker}/skyfed.acl {installed}/ && "
    pubs = " ".join(str(layout.enrolled / f"{name}.pub") for name in new)
    until = ("a broker and server installed from this folder's broker/ and server/ have them already: start at step 3"
             if fresh else "until then the broker drops what they publish and the server ignores them")
    lines = [
        f"next steps for {', '.join(new)} ({until}):",
        f"  1. broker host: {copy}systemctl reload mosquitto",
        f"  2. server host: skyfed keys enroll {pubs} --enrolled {ETC}/enrolled (no restart needed)",
    ]
    for step, name in enumerate(new, start=3):
        lines.append(f"  {step}. {name}: install {layout.agent(name)}/* in {ETC}/ (deploy/install-agent.sh), then "
                     f"skyfed agent check --config {ETC}/agent.toml && systemctl start skyfed-agent")  # fmt: skip
    return lines


def defaults_notes(plan: Provisioning, *, broker_given: bool, broker_dir_given: bool) -> list[str]:
    """For a federation just provisioned: where a default names something only right on some machines."""
    notes = []
    if not broker_given:
        notes.append(f"every node will connect to {plan.broker_host}:{plan.broker_port}, the default --broker, and the "
                     f"broker's certificate is for that name: make it resolve to the broker host on every node "
                     f"(DNS or /etc/hosts), or provision again into a new --out with --broker HOST:PORT")  # fmt: skip
    if not broker_dir_given:
        notes.append(f"mosquitto's skyfed.conf names {plan.broker_dir} (the default --broker-dir: this folder on "
                     f"this machine): on another broker host install the broker folder at exactly that path, or "
                     f"provision again into a new --out with --broker-dir /etc/mosquitto/skyfed")  # fmt: skip
    return notes


def eval_data_note(plan: Provisioning) -> str:
    return (
        f"server.toml has no server.eval_data, so no round is evaluated (no accuracy or mAP, no best model): put a "
        f"validation set on the server host (e.g. {plan.state_dir}/server/test.npz, or a YOLO data.yaml) and set "
        f"eval_data in {ETC}/server.toml"
    )


def git_work_tree(path: Path) -> Path | None:
    """The git work tree ``path`` lies in (a ``.git`` folder or file in it or a parent), or None."""
    for folder in [path.absolute(), *path.absolute().parents]:
        if (folder / ".git").exists():
            return folder
    return None


def checkout_warning(out: Path) -> str | None:
    tree = git_work_tree(out)
    if tree is None:
        return None
    return (
        f"{out} is inside the git work tree {tree}: it holds the CA's private key ({Layout(out).ca.key}) and every "
        f"node's key; move it out of the checkout (or at least keep it ignored: never commit it)"
    )


# peer mode ---------------------------------------------------------------------------------------------
def dashboard_instructions(out: Path, plan: Provisioning) -> list[str]:
    """With --ws-port: the dashboard command, and the certificate its browsers present."""
    if not plan.ws_port:
        return []
    dash = (out / "dashboard").absolute()
    return [f"  dashboard:   skyfed dashboard --broker {plan.broker_host}:{plan.broker_port} --ws-port {plan.ws_port} "
            f"--tls --federation {plan.federation} --port 8080",  # fmt: skip
            f"    each browser imports {dash}/dashboard.p12 (password in dashboard.p12.password) and trusts "
            f"{dash}/ca.crt; one browser tab at a time per certificate"]  # fmt: skip


def peer_instructions(out: Path, plan: Provisioning) -> str:
    """How to install and watch a peer federation (also kept as DIR/README.txt)."""
    f, mon = plan.federation, (out / "monitor").absolute()
    tls = f"--cafile {mon}/ca.crt --cert {mon}/monitor.crt --key {mon}/monitor.crt.key"
    where = f"{plan.broker_host}:{plan.broker_port}"
    topics = " ".join(f"-t 'skyfed/{f}/peer/+/{leaf}'" for leaf in ("member", "metrics", "best"))
    return "\n".join(
        [
            f"SkyFed peer federation {f!r} (no server): broker {where}",
            f"  broker host: install {out}/broker as {plan.broker_dir} (cp -a keeps owners and modes),",
            f"    ln -s {plan.broker_dir}/skyfed.conf /etc/mosquitto/conf.d/skyfed.conf; systemctl restart mosquitto",
            f"  each peer:   install {out}/peers/<id>/* in {ETC}/ on the device (enrolled/ included); fill in the "
            "round plan in [federation] of its agent.toml, the same on every peer;",
            f"               its data goes to {plan.state_dir}/<id>/data.npz and its validation split to test.npz",
            f"  monitor:     mosquitto_sub -h {plan.broker_host} -p {plan.broker_port} {tls} {topics} -v",
            *dashboard_instructions(out, plan),
            f"  add peers:   skyfed provision --mode peer --federation {f} --agents <all ids> --out {out} "
            "(existing keys stay)",
            f"  revoke:      skyfed provision revoke <id> --out {out}",
            f"  keep {out}/ca/ca.crt.key offline: it signs every certificate of the federation",
        ]
    )


def peer_next_steps(out: Path, plan: Provisioning, new: list[str]) -> list[str]:
    """For the peers just added: the broker's ACL, the installed peers' enrolled folders, the new devices."""
    if not new:
        return []
    layout = Layout(out)
    installed = Path(plan.broker_dir)
    copy = "" if installed == layout.broker.absolute() else f"cp -p {layout.broker}/skyfed.acl {installed}/ && "
    pubs = " ".join(str(layout.peers_enrolled / f"{name}.pub") for name in new)
    lines = [
        f"next steps for {', '.join(new)} (until then the broker drops what they publish and the other peers "
        "refuse them):",
        f"  1. broker host: {copy}systemctl reload mosquitto",
        f"  2. every peer already installed: skyfed keys enroll {pubs} --enrolled {ETC}/enrolled (no restart needed)",
    ]
    for step, name in enumerate(new, start=3):
        lines.append(f"  {step}. {name}: install {layout.peer(name)}/* in {ETC}/ (deploy/install-agent.sh), fill in "
                     f"[federation] in {ETC}/agent.toml, then skyfed agent check --config {ETC}/agent.toml && "
                     "systemctl start skyfed-agent")  # fmt: skip
    return lines


def peer_revoke_text(out: Path, plan: Provisioning, peer: str, serial: int) -> str:
    layout = Layout(out)
    installed = Path(plan.broker_dir)
    copy = "" if installed == layout.broker.absolute() else (
        f"cp -p {layout.broker}/crl.pem {layout.broker}/skyfed.acl {installed}/; ")  # fmt: skip
    return (
        f"revoked {peer}: its key moved to revoked/ in {layout.peers_enrolled} and in every peer folder here, its "
        f"certificate (serial {serial:x}) is in {layout.broker}/crl.pem and the ACL no longer names it\n"
        f"  broker: {copy}systemctl reload mosquitto (new connections check the CRL; the ACL applies at once)\n"
        f"  each installed peer: skyfed keys revoke {peer} --enrolled {ETC}/enrolled (a running peer drops it "
        "within a second, no restart)"
    )
