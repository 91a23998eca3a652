"""The broker's side of a federation: mosquitto's ACL and config for mutual TLS (pure text, no I/O).

With ``use_identity_as_username`` the certificate CN is the MQTT user name, so the ACL names each node;
``use_username_as_clientid`` makes it the client id as well, so no certificate can take over another
node's session (mosquitto lets a new connection evict an existing client id, whoever presents it).
Every node gets its own ``user`` block and nothing else (no ``pattern`` lines: those apply to every
user, monitors included): an agent writes only its own status and updates and reads only the round
task, the model, the server's status (to see a run end), its own status (to see that the broker keeps
what it sends: ``agent.echo``) and its own inbox; a monitor reads status and metrics and writes nothing; the server
reads and writes the federation's tree. ``deploy/mosquitto/`` holds these files for an example fleet.

Peer mode (``peer_acl_text``, no server): a peer writes only its own subtree ``peer/<id>/#`` and reads
every peer's membership, metrics and best score and the chunks sealed to it (``peer/+/to/<id>``);
a monitor reads membership, metrics and best scores. ``deploy/mosquitto/peer.acl`` is an example.
"""

from __future__ import annotations

from pathlib import Path

MAX_PACKET_SIZE = 4 << 20  # SkyFed chunks are ~1 MiB plus a small header: refuse anything much larger
MAX_QUEUED_MESSAGES = 10000  # room for model chunks queued for agents that are offline (QoS 1 sessions)
MAX_QUEUED_BYTES = 256 << 20  # and a byte bound per client, so one agent cannot make the broker queue GiBs


def participant_block(federation: str, name: str) -> list[str]:
    """What one participant of ``federation`` (an agent; a region at its root) may read and write."""
    root = f"skyfed/{federation}"
    return [
        f"user {name}",
        f"topic read {root}/round",
        f"topic read {root}/model/#",
        f"topic read {root}/server/status",
        f"topic readwrite {root}/agent/{name}/status",
        f"topic write {root}/agent/{name}/update",
        f"topic read {root}/agent/{name}/inbox",
    ]


def monitor_reads(root: str) -> list[str]:
    """Status, metrics and history: never a model, an update or an inbox."""
    return [f"topic read {root}/{leaf}" for leaf in ("server/status", "server/metrics", "server/history",
                                                      "agent/+/status")]  # fmt: skip


def acl_text(federation: str, agents: list[str], upstream: tuple[str, str] | None = None) -> str:
    """The ACL of a federation's broker; a region's (``upstream``: its id and its root's federation) also lets
    its participant at the root use the root's topics that its bridge carries (``provisioning.bridge``)."""
    root = f"skyfed/{federation}"
    lines = [
        f"# mosquitto ACL for SkyFed federation {federation!r}, written by skyfed provision: edits are",
        "# overwritten, re-run skyfed provision instead. User names are certificate CNs.",
        "",
        "# the aggregator: the whole federation, and agent status of every federation (to spot a",
        "# device configured with the wrong federation name)",
        "user server",
        f"topic readwrite {root}/#",
        "topic read skyfed/+/agent/+/status",
        "",
        "# monitoring: status and metrics, read only; one certificate each for skyfed monitor and mosquitto_sub",
        "# (the broker holds one connection per certificate: a second one evicts the first)",
        "user monitor",
        *monitor_reads(root),
        "",
        "user monitor-sub",
        *monitor_reads(root),
        "",
        "# the dashboard page in a browser (skyfed dashboard, over the WebSockets listener): the same, read only",
        "user dashboard",
        *monitor_reads(root),
    ]
    for agent in agents:
        lines += ["", *participant_block(federation, agent)]
    if upstream is not None:
        region, root_federation = upstream
        lines += ["", f"# this region's participant in the root federation {root_federation!r}, over the bridge",
                  *participant_block(root_federation, region)]  # fmt: skip
    return "\n".join(lines) + "\n"


def peer_acl_text(federation: str, peers: list[str]) -> str:
    root = f"skyfed/{federation}/peer"
    shared = [f"topic read {root}/+/member", f"topic read {root}/+/metrics", f"topic read {root}/+/best"]
    lines = [
        f"# mosquitto ACL for SkyFed peer federation {federation!r} (no server), written by skyfed provision",
        "# --mode peer: edits are overwritten, re-run skyfed provision instead. User names are certificate CNs.",
        "",
        "# monitoring (mosquitto_sub): membership, metrics and best scores (with each peer's decision), read only",
        "user monitor",
        *shared,
        "",
        "# the dashboard page in a browser (skyfed dashboard, over the WebSockets listener): the same, read only",
        "user dashboard",
        *shared,
    ]
    for peer in peers:
        lines += ["", f"user {peer}", f"topic write {root}/{peer}/#", *shared, f"topic read {root}/+/to/{peer}"]
    return "\n".join(lines) + "\n"


def listener_tls(broker_dir: Path) -> list[str]:
    """Mutual TLS on a listener: a client certificate from the federation CA, its CN the user name and client id."""
    return [
        f"cafile {broker_dir / 'ca.crt'}",
        f"certfile {broker_dir / 'broker.crt'}",
        f"keyfile {broker_dir / 'broker.crt.key'}",
        f"crlfile {broker_dir / 'crl.pem'}",
        "require_certificate true",
        "use_identity_as_username true",
        "# the client id is the certificate name too: nobody can take over another node's session by",
        "# choosing its client id (one connection per certificate at a time)",
        "use_username_as_clientid true",
    ]


def websockets_bind(listen: str) -> str:
    """What a WebSockets listener line names for ``listen``. mosquitto 2.0 hands it to libwebsockets, which binds
    every address for an IPv4 address (``listener 9001 127.0.0.1`` listens on all of them) but honours an
    interface name: loopback becomes ``lo``. Any other address still binds everywhere, so mutual TLS is what
    keeps that listener closed (docs/dashboard.md)."""
    return "lo" if listen in ("127.0.0.1", "localhost") else listen


def websockets_listener(ws_port: int, listen: str, broker_dir: Path) -> list[str]:
    """MQTT over WebSockets for ``skyfed dashboard``'s page; none when ``ws_port`` is 0."""
    if not ws_port:
        return []
    bind = websockets_bind(listen)
    return [
        "# MQTT over WebSockets for the skyfed dashboard page (docs/dashboard.md): the same mutual TLS; the",
        "# browser presents the dashboard certificate (import DIR/dashboard/dashboard.p12), read-only ACL.",
        "# mosquitto 2.0 binds this listener on every address unless it names an interface (lo): the",
        "# certificate it requires is what keeps anyone else out",
        f"listener {ws_port}{f' {bind}' if bind else ''}",
        "protocol websockets",
        *listener_tls(broker_dir),
        "",
    ]


def mosquitto_conf_text(port: int, listen: str, broker_dir: Path, ws_port: int = 0) -> str:
    """A ``conf.d`` snippet: Debian's main mosquitto.conf already sets persistence and logging."""
    return "\n".join(
        [
            "# mosquitto 2.x for SkyFed, written by skyfed provision: mutual TLS only. Install the folder",
            f"# as {broker_dir}, link this file into /etc/mosquitto/conf.d/, then systemctl restart",
            "# mosquitto. After skyfed provision adds or revokes an agent: systemctl reload mosquitto.",
            "per_listener_settings false",
            "allow_anonymous false",
            f"max_packet_size {MAX_PACKET_SIZE}",
            f"max_queued_messages {MAX_QUEUED_MESSAGES}",
            f"max_queued_bytes {MAX_QUEUED_BYTES}",
            f"acl_file {broker_dir / 'skyfed.acl'}",
            "",
            f"listener {port}{f' {listen}' if listen else ''}",
            *listener_tls(broker_dir),
            "",
            *websockets_listener(ws_port, listen, broker_dir),
        ]
    )
