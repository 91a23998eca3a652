"""``skyfed data``: example and real data for a fleet's agents.

``digits AGENT…`` (the bundled digits for classifiers; the older spelling ``skyfed data AGENT…`` still
works, see ``skyfed.main``), ``visdrone-to-yolo SRC DST`` and ``partition DATA_YAML …`` (YOLO detection
data). This module only parses arguments and prints; it never converts or splits data itself
(models/visdrone.py, models/yolo_partition.py) and never shows a traceback for bad input (exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SUBCOMMANDS = ("digits", "visdrone-to-yolo", "partition")
MOTOR_HELP = (
    "VisDrone's category 10 'motor', which the thesis (seed 001) never names: keep (default) → 10 classes, the "
    "names and order of Ultralytics' VisDrone.yaml; drop → the thesis' 9 classes (motor rows counted as dropped)"
)


def run_digits(args: argparse.Namespace) -> int:
    from models.partition import parse
    from security.keys import check_name
    from sim.federation import describe_partition, write_digits_data

    try:
        names = [check_name(a) for a in args.agents]
        parse(args.partition)
    except ValueError as exc:
        return _fail("digits", exc)
    out = Path(args.out)
    histogram = write_digits_data(out, names, args.partition, args.seed)
    print(f"wrote {out / 'server' / 'test.npz'} (the server's eval_data)")
    for name, line in zip(names, describe_partition(histogram, names), strict=True):
        print(f"wrote {out / name / 'data.npz'} ({line.split(': ', 1)[1]})")
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
    data = commands.add_parser("data", help="data for agents: digits, visdrone-to-yolo, partition")
    sub = data.add_subparsers(dest="data_command", required=True)
    digits = sub.add_parser(
        "digits",
        help="example data for a deployment: OUT/<agent>/data.npz and the server's OUT/server/test.npz",
        description="scikit-learn's bundled 8x8 digits (nothing is downloaded): 20 %% held out for the server's "
        "evaluation (OUT/server/test.npz, its server.eval_data), the rest split across the named agents "
        "(OUT/<agent>/data.npz, each agent's agent.data), in the format the agent reads.",
    )
    digits.add_argument("agents", nargs="+", help="agent ids, e.g. drone-01 drone-02 drone-03")
    digits.add_argument("--out", default=".", help="folder to write into (default: here)")
    digits.add_argument("--partition", default="iid", help="iid | shards | dirichlet:ALPHA (label skew)")
    digits.add_argument("--seed", type=int, default=0)
    digits.set_defaults(handler=run_digits)

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
