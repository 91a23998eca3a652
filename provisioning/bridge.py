"""A region's mosquitto bridge to its root's broker (pure text, no I/O; docs/architecture.md "Regions").

The region's broker carries the root federation's topics of one participant, the region (``upstream.id``),
over one bridge connection that authenticates to the root's broker with the region's certificate: the round
task, the model chunks and the server's status come in; the region's status and update go out; its inbox
(the group key, start models) both ways. These are exactly the topics the root's ACL grants that participant
(``provisioning.broker_files.acl_text``), so nothing else of the root federation crosses the bridge: not the
other regions' updates, nor their status. QoS 1 both ways (a bridge topic's QoS defaults to 0, ``man 5
mosquitto.conf``); ``try_private`` keeps a message from coming back over the bridge it crossed.

Retained messages removed at the root while a bridge is down are not removed on the region's side when it
comes back (eclipse/mosquitto#1040): the region may keep stale retained model chunks and round tasks of the
root. SkyFed does not rely on their absence: a participant takes only the newest signed round task of the
root's run (``agent.task_check``), and only the model chunks of the version that task names, checked
against its SHA-256; a chunk of an older version is never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BridgeTls:
    """The root's CA and the region's certificate, as the root's broker requires of every participant."""

    cafile: Path
    certfile: Path
    keyfile: Path


def bridge_topics(federation: str, region: str) -> list[str]:
    """The ``topic`` lines: the root federation's topics the region's participant reads or writes."""
    root = f"skyfed/{federation}"
    return [f"topic {root}/round in 1", f"topic {root}/model/# in 1", f"topic {root}/server/status in 1",
            f"topic {root}/agent/{region}/# both 1"]  # fmt: skip


def bridge_conf_text(federation: str, region: str, address: str, tls: BridgeTls | None = None) -> str:
    """A ``conf.d`` snippet for the region's broker: one bridge to the root's broker at ``address`` (HOST:PORT)."""
    lines = [
        f"# mosquitto bridge of region {region!r} to the root federation {federation!r}, written by skyfed",
        "# provision. Bridges are not re-read on SIGHUP: systemctl restart mosquitto after editing.",
        f"connection skyfed-{federation}-{region}",
        f"address {address}",
        f"remote_clientid {region}",  # the certificate's name: the root's broker takes it as the client id
        "bridge_protocol_version mqttv311",
        "cleansession false",  # the root keeps the bridge's subscriptions and queued QoS 1 messages across drops
        "try_private true",
        "notifications false",  # no $SYS connection notices on the root's broker (its ACL refuses them anyway)
        "restart_timeout 2 30",
        *bridge_topics(federation, region),
    ]
    if tls is not None:
        lines += [f"bridge_cafile {tls.cafile}", f"bridge_certfile {tls.certfile}", f"bridge_keyfile {tls.keyfile}"]
    return "\n".join(lines) + "\n"
