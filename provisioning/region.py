"""``skyfed provision … --upstream ROOT/agents/<region>``: a region's federation under a root.

The root provisions each region as one of its participants (``skyfed provision --agents region-1,…``), which
writes ``ROOT/agents/region-1/``: the region's key, its certificate from the root's CA, the root server's
public key and the root broker's address. Given that folder, the region's provisioning adds:

- ``server/upstream/``: the region's key and the root's public key, and ``[upstream]`` in server.toml;
- a certificate ``CN = <region>`` from the region's own CA (``server/upstream/local/``), with which the
  participant connects to the region's broker (``[upstream.broker]``): a client id of its own, so it does not
  take over the aggregator's connection, and an ACL block for the root's topics it uses;
- ``broker/bridge.conf`` (``provisioning.bridge``) and ``broker/upstream/``: the root's CA and the region's root
  certificate, with which the region's broker bridges to the root's;
- ``server/upstream/root/``: the same root certificate, for a region that connects to the root's broker
  directly instead (server.toml says how).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from common import toml
from protocol.config import write_toml
from protocol.topics import check_level
from provisioning.bridge import BridgeTls, bridge_conf_text
from provisioning.provision import Layout, ProvisionError, Provisioning, certificate, tls_settings

LINK = "{region}@{federation}"  # how provision.json records the upstream


def read_root_folder(folder: Path) -> tuple[str, str, str]:
    """``(region id, root federation, root broker HOST:PORT)`` of the root's folder for this region."""
    try:
        config = toml.loads((folder / "agent.toml").read_text())
        region, federation = config["agent"]["id"], config["agent"]["federation"]
        address = f"{config['broker']['host']}:{config['broker']['port']}"
        check_level("agent.id", region)
        check_level("agent.federation", federation)
    except (OSError, KeyError, TypeError, ValueError, toml.TOMLDecodeError) as exc:
        raise ProvisionError(f"--upstream {folder}: not a folder the root's skyfed provision wrote for a region "
                             f"(ROOT/agents/<region>/ with agent.toml): {exc}") from None  # fmt: skip
    for name in (f"{region}.key", f"{region}.crt", f"{region}.crt.key", "ca.crt", "server.pub"):
        if not (folder / name).is_file():
            raise ProvisionError(f"--upstream {folder}: {name} is missing")
    return region, federation, address


def attach_upstream(layout: Layout, plan: Provisioning, folder: Path) -> None:
    """Make the provisioned region in ``layout`` a participant of the root that wrote ``folder`` (once)."""
    region, federation, address = read_root_folder(folder)
    link = LINK.format(region=region, federation=federation)
    if plan.upstream and plan.upstream != link:
        raise ProvisionError(f"{layout.out} is already the region {plan.upstream}, not {link}")
    if federation == plan.federation:
        raise ProvisionError(f"--federation {plan.federation} is the root's federation too: give the region its own")
    upstream, bridge = layout.server / "upstream", layout.broker / "upstream"
    for target in (upstream / "root", bridge):
        target.mkdir(parents=True, exist_ok=True)
        for name in (f"{region}.crt", f"{region}.crt.key", "ca.crt"):
            shutil.copyfile(folder / name, target / name)
    shutil.copyfile(folder / f"{region}.key", upstream / f"{region}.key")
    shutil.copyfile(folder / "server.pub", upstream / "root.pub")
    if not (upstream / "local" / f"{region}.crt").exists():
        certificate(layout, upstream / "local", region)
    _server_toml(layout.server / "server.toml", plan, region, federation, address)
    installed = Path(plan.broker_dir) / "upstream"
    tls = BridgeTls(installed / "ca.crt", installed / f"{region}.crt", installed / f"{region}.crt.key")
    (layout.broker / "bridge.conf").write_text(bridge_conf_text(federation, region, address, tls))
    plan.upstream = link


def _server_toml(path: Path, plan: Provisioning, region: str, federation: str, address: str) -> None:
    config = toml.loads(path.read_text())
    local = {key: f"upstream/local/{value}" for key, value in tls_settings(region).items()}
    config["upstream"] = {"id": region, "federation": federation, "identity": f"upstream/{region}.key",
                          "server": "upstream/root.pub",
                          "broker": {"host": plan.broker_host, "port": plan.broker_port, "tls": local}}  # fmt: skip
    root = {key: f"upstream/root/{value}" for key, value in tls_settings(region).items()}
    host, _, port = address.rpartition(":")
    write_toml(path, config, footer="\n".join([
        "# [upstream.broker] is this region's broker, bridged to the root's (broker/bridge.conf). To connect to the",
        "# root's broker directly instead (no bridge), point it there with the root's certificate:",
        "#   [upstream.broker]", f'#   host = "{host}"', f"#   port = {port}", "#   [upstream.broker.tls]",
        *(f'#   {key} = "{value}"' for key, value in root.items()),
    ]) + "\n")  # fmt: skip
