"""``skyfed agent run|check --config agent.toml`` and ``skyfed agent infer --image F``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from protocol.daemon import Daemon


def load_checked_agent_config(path: Path, *, create: bool = True) -> AgentConfig:
    """``agent.toml`` parsed and its state folder writable: everything checked before the heavy imports."""
    from agent.config import load_agent_config
    from protocol.config_check import load_checked

    return load_checked(load_agent_config, path, "agent.state_dir", create=create)


def build_agent(config: AgentConfig, *, again_ok: bool = True) -> Daemon:
    """The daemon ``skyfed agent run`` runs (and ``skyfed.api.Agent``) for a checked config: it locks the state
    folder (``again_ok``: as ``common.lock.hold_state_dir``) and builds the edge node's role (agent.edge_node):
    the agent, or a peer in peer mode."""
    from common.lock import hold_state_dir

    hold_state_dir(config.state_dir, "agent.state_dir", again_ok=again_ok)  # before anything reads or writes it
    if config.peer_mode:  # federation.mode = "peer": no server (agent.peer)
        from agent.peer.node import PeerNode

        return PeerNode(config)
    from agent.daemon import EdgeAgent  # PyTorch: seconds, so only once the config is known good

    return EdgeAgent(config)


def run_agent(args: argparse.Namespace) -> int:
    from protocol.daemon import run_daemon

    return run_daemon("agent", lambda: build_agent(load_checked_agent_config(Path(args.config))))


def check_agent(args: argparse.Namespace) -> int:
    """``skyfed agent check``: exit 0 with ``ok: ...``, or 2 with the error naming the key and the fix."""
    from protocol.config_check import report_check

    def summary(config: AgentConfig) -> str:
        a, b = config.agent, config.broker
        return (f"{args.config}: id={a.id} federation={a.federation} trainer={config.training.trainer} "
                f"broker={b.address_list} tls={'yes' if b.tls else 'no'} state_dir={config.state_dir} "
                f"data={config.data_path}"
                + (f" data_loader={a.data_loader}" if a.data_loader else "")
                + (f" model={config.own_model}" if config.own_model else "")
                + (f" test_data={config.test_data_path}" if config.test_data_path else "")
                + config.metrics.summary())  # fmt: skip

    def load() -> AgentConfig:
        from agent.profile import read_start_files

        config = load_checked_agent_config(Path(args.config), create=False)
        if not config.peer_mode:  # a peer reads its enrolled folder, checked by the config already
            read_start_files(config)  # the keys and the data, as `agent run` reads them
        return config

    return report_check("skyfed agent check", load, summary)


def infer_images(args: argparse.Namespace) -> int:
    """Print one JSON line per image; bad input is exit 2 with one line on stderr, not a traceback."""
    from agent.infer import image_files, infer

    try:
        if args.model:
            model = Path(args.model)
        elif args.config:
            from agent.config import load_agent_config

            model = load_agent_config(Path(args.config)).state_dir / "global_model.onnx"
        else:
            raise ValueError("give --model PATH, or --config agent.toml to use <state_dir>/global_model.onnx")
        results = infer(model, image_files(Path(args.image)), conf=args.conf, iou=args.iou)
    except ValueError as exc:  # ConfigError is a ValueError too
        print(f"skyfed agent infer: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    for result in results:
        print(json.dumps(result))
    return 0


def add_agent_commands(commands: argparse._SubParsersAction) -> None:
    agent = commands.add_parser("agent", help="the edge agent daemon").add_subparsers(dest="action", required=True)
    run = agent.add_parser("run", help="run the agent (systemd runs this)")
    run.add_argument("--config", required=True, help="path to agent.toml")
    run.set_defaults(handler=run_agent)
    check = agent.add_parser("check", help="check agent.toml (and that state_dir is writable) without starting")
    check.add_argument("--config", required=True, help="path to agent.toml")
    check.set_defaults(handler=check_agent)
    infer = agent.add_parser("infer", help="run the exported ONNX model on images, one JSON line per image")
    infer.add_argument("--image", required=True, help="an image file, or a folder of images")
    infer.add_argument("--model", help="a SkyFed .onnx (default: <state_dir>/global_model.onnx of --config)")
    infer.add_argument("--config", help="path to agent.toml, to find the model in its state_dir")
    infer.add_argument("--conf", type=float, default=0.25, help="detection confidence threshold")
    infer.add_argument("--iou", type=float, default=0.45, help="NMS IoU threshold (same class)")
    infer.set_defaults(handler=infer_images)
