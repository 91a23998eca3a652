"""What ``skyfed sim`` says at start about settings that would change nothing. A flag moved off its default in a
shape of run that never reads it (``NOT_READ``), or a share ratio that shares no data, is refused with the reason
(``check_read``, from ``SimSettings``); what the server would only write in its log about the strategy (a Krum f
lowered to nothing, a swap cycle cut short) is said on the console (``start_warnings``).

``NOT_READ``'s keys are ``SimSettings`` fields; a field's flag is its name with dashes (``share_ratio``:
``--share-ratio``) unless ``FLAGS`` names it.
"""

from __future__ import annotations

import logging
from dataclasses import MISSING, fields
from typing import Any

from sim.classify_layout import smallest_ratio

FLAGS = {"privacy": "--dp-*", "local_privacy": "--ldp-*", "deadline_s": "--deadline", "pooled": "pooled",
         "mode": "--mode peer", "asynchronous": "--async"}  # fmt: skip

NOT_READ: dict[str, dict[str, str]] = {
    "--mode peer": {
        "pooled": "each peer trains on its own share",
        "share": "peers exchange whole models",
        "in_process": "peers are daemons over a broker",
        "privacy": "central DP needs a server to clip and add the noise",
        "fraction": "every member trains every round",
        "codec": "peers send their models uncompressed",
        "share_ratio": "there is no server to train a shared pool",
        "optimizer": "the peers' round plan ([federation]) trains with SGD",
        "keep_momentum": "the peers' round plan ([federation]) has no momentum carry-over",
        "local_privacy": "the sim writes no [privacy] into a peer's agent.toml",
        "availability": "a peer run ends once every peer has run every round, so a peer the trace keeps away "
                        "holds it open",
        "asynchronous": "peers have no server to buffer their updates",
    },
    "--regions": {
        "mode": "regions are servers",
        "in_process": "regions are daemons over bridged brokers",
        "pooled": "each region's agents train on their own shares",
        "share_ratio": "no region trains a shared pool",
        "asynchronous": "a region's rounds follow its root's (asynchronous regions are not built)",
    },
    "--in-process": {
        "agents_per_process": "its agents are no processes",
        "worker": "its trainers run in this process, without a training child",
        "deadline_s": "every selected agent delivers, so no round waits for a deadline",
        "availability": "its agents have no device gate and no clock of their own: run them as daemons",
        "asynchronous": "its agents all train every round at once, so no update is ever behind: run them as daemons",
    },
    "--task classify": {
        "image_size": "it is the detector's image size",
        "images_per_agent": "it sizes the synthetic detection data",
        "density_skew": "it skews the synthetic detection data",
        "share": "it says what of a detector is averaged",
        "init_weights": "it is a detector's start checkpoint",
    },
}


def flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def check_read(settings: Any, filled: dict[str, Any]) -> None:  # noqa: ANN401 - a SimSettings
    """Refuse a flag, off its default, that a shape of ``settings`` never reads (``NOT_READ``), naming why. ``filled``:
    what ``SimSettings`` fills in itself (a copy made by ``dataclasses.replace`` holds it), never a user's flag."""
    shapes = {"--mode peer": settings.mode == "peer", "--regions": bool(settings.regions),
              "--in-process": settings.in_process, "--task classify": settings.task == "classify"}  # fmt: skip
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                for f in fields(settings)}  # fmt: skip
    for shape, unread in NOT_READ.items():
        for name, why in unread.items():
            if shapes[shape] and getattr(settings, name) not in (defaults[name], filled.get(name, defaults[name])):
                raise ValueError(f"{flag(name)} is not available with {shape}: {why}; drop it")
    if settings.share_mode != defaults["share_mode"] and not settings.share_ratio:
        raise ValueError(f"--share-mode {settings.share_mode} needs --share-ratio R: without it no data is shared")
    ratio, agents = settings.share_ratio, settings.agents
    if 0 < ratio and settings.share_mode == "unify" and int(ratio * agents) == 0:
        raise ValueError(f"--share-ratio {ratio:g} with --share-mode unify gives floor({ratio:g} x {agents} agents) "
                         "= 0 agents' data to the server's pool, so there would be no pool: use --share-ratio "
                         f"{smallest_ratio(agents):g} or more (one agent's data)")  # fmt: skip


def start_warnings(settings: Any) -> list[str]:  # noqa: ANN401 - a checked SimSettings
    """The server's warnings at start about the strategy this run gives it (``Strategy.run_warnings``, Krum's f
    lowered for too few agents), which would otherwise be in the run's server.log only. Peers warn in theirs."""
    import math

    from broker_server.privacy.policy import PrivacyPolicy
    from flcore.rounds import RoundRules
    from flcore.strategies import build_strategy
    from flcore.strategies.choice import strategy_notes
    from protocol.typed import build

    if settings.mode == "peer":
        return []
    table = build(PrivacyPolicy, settings.privacy, where="privacy", strict=True).strategy_table(settings.strategy)[0]
    participants = settings.regions or (1 if settings.pooled else settings.running_agents)
    selected = max(1, math.ceil(settings.fraction * participants))
    rules = RoundRules(fraction=settings.fraction, min_agents=selected, quorum=max(1, selected // 2))
    notes = [note.text for note in strategy_notes(table, participants, rules) if note.level >= logging.WARNING]
    return notes + build_strategy(table).run_warnings(settings.rounds)
