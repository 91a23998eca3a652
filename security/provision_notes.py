"""What ``skyfed provision`` tells the operator after writing: the steps that make new agents work, the
missing evaluation data, and a provisioning folder (with the CA's private key) inside a git checkout."""

from __future__ import annotations

from pathlib import Path

from security.provision import Layout, Provisioning

ETC = "/etc/skyfed"  # where deploy/install-*.sh install a node's folder


def next_steps(out: Path, plan: Provisioning, new: list[str]) -> list[str]:
    """Exact commands, in order, for the agents just added: until the broker reloads its ACL it drops every
    message they send (while they log "mqtt connected"), and until the server holds their keys it ignores them."""
    if not new:
        return []
    layout = Layout(out)
    installed = Path(plan.broker_dir)
    copy = "" if installed == layout.broker.absolute() else f"cp -p {layout.broker}/skyfed.acl {installed}/ && "
    pubs = " ".join(str(layout.enrolled / f"{name}.pub") for name in new)
    lines = [
        f"next steps for {', '.join(new)} (until then the broker drops what they publish and the server ignores them):",
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
