"""``skyfed data``: example and real data for a fleet's agents.

``digits AGENT…``, ``mnist1d AGENT…`` (one per ``models.classify_data`` dataset, generated offline; the older
spelling ``skyfed data AGENT…`` means digits, see ``skyfed.main``), ``visdrone-to-yolo SRC DST`` and
``partition DATA_YAML …`` (YOLO detection data). This module only parses arguments and prints; it never
converts or splits data itself (models/visdrone.py, models/yolo_partition.py, sim/federation.py) and never
shows a traceback for bad input (exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.classify_data import DATASETS
from models.partition import FORMS

MOTOR_HELP = (
    "VisDrone's category 10 'motor', which the thesis (seed 001) never names: keep (default) → 10 classes, the "
    "names and order of Ultralytics' VisDrone.yaml; drop → the thesis' 9 classes (motor rows counted as dropped)"
)


def subcommands() -> tuple[str, ...]:
    """The classify datasets (one plug-in each, a test's too) and the YOLO data tools."""
    return (*DATASETS.names(), "visdrone-to-yolo", "partition")


def run_classify_data(args: argparse.Namespace) -> int:
    from models.partition import parse_plan
    from security.keys import check_name
    from sim.classify_layout import describe_partition, write_classify_data

    try:
        names = [check_name(a) for a in args.agents]
        parse_plan(args.partition)
    except ValueError as exc:
        return _fail(args.dataset, exc)
    out = Path(args.out)
    train, test, domains = write_classify_data(out, names, args.partition, args.seed, args.dataset)
    print(f"wrote {out / 'server' / 'test.npz'} (the server's eval_data"
          f"{': every agent transformation on an equal part' if any(domains) else ''})")  # fmt: skip
    for name, line in zip(names, describe_partition(train, test, names, domains), strict=True):
        print(f"wrote {out / name / 'data.npz'} and test.npz (its agent.data and agent.test_data: "
              f"{line.split(': ', 1)[1]})")  # fmt: skip
    return 0


def run_visdrone(args: argparse.Namespace) -> int:
    from models.visdrone import convert, format_summary
    from models.yolo_dataset import DatasetError

    try:
        summary = convert(Path(args.src), Path(args.dst), args.motor)
    except (DatasetError, OSError) as exc:
        return _fail("visdrone-to-yolo", exc)
    print("\n".join(format_summary(summary)))
    return 0


def run_partition(args: argparse.Namespace) -> int:
    from models.yolo_dataset import DatasetError
    from models.yolo_partition import format_partition, partition_dataset

    try:
        partition = partition_dataset(
            Path(args.data_yaml), args.agents, args.scheme, Path(args.out), args.seed, args.copy
        )
    except (DatasetError, OSError) as exc:
        return _fail("partition", exc)
    print("\n".join(format_partition(partition)))
    return 0


def _fail(command: str, exc: Exception) -> int:
    print(f"skyfed data {command}: {exc}", file=sys.stderr)
    return 2


def add_data_commands(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help=f"data for agents: {', '.join(subcommands())}")
    sub = data.add_subparsers(dest="data_command", required=True)
    for dataset, plugin in DATASETS.items():
        classify = sub.add_parser(
            dataset,
            help="example data for a deployment: OUT/<agent>/data.npz, test.npz and the server's OUT/server/test.npz",
            description=f"{plugin.about} (OUT/server/test.npz, its server.eval_data); the rest split across the "
            "named agents, "
            "each agent's share cut into OUT/<agent>/data.npz (its agent.data) and OUT/<agent>/test.npz (its "
            "agent.test_data: 20 % of the share, stratified by label, never trained on), in the format the agent "
            "reads.",
        )
        classify.add_argument("agents", nargs="+", help="agent ids, e.g. drone-01 drone-02 drone-03")
        classify.add_argument("--out", default=".", help="folder to write into (default: here)")
        classify.add_argument("--partition", default="iid",
                              help=f"{FORMS}; shards = shards:2, K label-sorted shards per agent; dirichlet: "
                              "label skew; feature-skew: each agent's own input transformation")  # fmt: skip
        classify.add_argument("--seed", type=int, default=0)
        classify.set_defaults(handler=run_classify_data, dataset=dataset)

    convert = sub.add_parser(
        "visdrone-to-yolo",
        help="VisDrone-DET → YOLO: DST/images/{split}, DST/labels/{split}, DST/data.yaml",
        description="SRC: one VisDrone-DET split folder (images/ + annotations/) or a folder holding "
        "VisDrone2019-DET-train, -val, -test-dev (→ train, val, test). Rows dropped and counted: score 0 (ignored "
        "regions), category 0 (ignored), 11 (others), boxes with no area inside the image. A malformed annotation "
        "line is an error naming file and line. Images are hard-linked when on the same filesystem, else copied.",
    )
    convert.add_argument("src", metavar="SRC", help="VisDrone-DET split folder, or the folder holding the splits")
    convert.add_argument("dst", metavar="DST", help="new (or empty) folder for the YOLO dataset")
    convert.add_argument("--motor", choices=["keep", "drop"], default="keep", help=MOTOR_HELP)
    convert.set_defaults(handler=run_visdrone)

    part = sub.add_parser(
        "partition",
        help="split a YOLO dataset's train images across agents: DST/agent-01/data.yaml, …",
        description="Each agent's data.yaml names its train images and the source's whole val split, as "
        "absolute-path .txt lists (or, with --copy, real copies). Deterministic for a given --seed.",
    )
    part.add_argument("data_yaml", metavar="DATA_YAML", help="the source dataset's data.yaml")
    part.add_argument("--agents", type=int, required=True, metavar="N", help="number of agents (1 … train images)")
    part.add_argument(
        "--scheme",
        required=True,
        help="uniform (random, equal image counts) | class-skew[:DOMINANCE] (each agent mostly images dominated "
        "by its own class, DOMINANCE in (0, 1], default 0.8) | by-source (whole source sequences per agent: "
        "file-name part before the first '_')",
    )
    part.add_argument("--out", required=True, metavar="DST", help="new (or empty) folder for agent-01/, agent-02/, …")
    part.add_argument("--seed", type=int, default=0)
    part.add_argument("--copy", action="store_true", help="copy images and labels (to ship to a device)")
    part.set_defaults(handler=run_partition)
