"""``skyfed sim``, ``skyfed demo`` and ``skyfed report``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flcore.staleness import DEFAULT_STALENESS
from sim.summary import summary_lines


def parse_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as a TOML value when it is one (``beta=0.2``, ``f=2``), else a string."""
    from common import toml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"option {text!r} must look like KEY=VALUE, e.g. beta=0.2")
    try:
        return key, toml.loads(f"v = {value}")["v"]
    except toml.TOMLDecodeError:
        return key, value


def _settings(args: argparse.Namespace):  # noqa: ANN202
    from sim.federation import SimSettings

    strategy = dict(parse_option(o) for o in args.strategy_option)
    if args.strategy:
        strategy["name"] = args.strategy
    bounds = dict(parse_option(o) for o in args.bounds_option)
    privacy = {key: value for key, value in (("clip", args.dp_clip), ("noise_multiplier", args.dp_noise),
               ("target_epsilon", args.dp_target_epsilon), ("delta", args.dp_delta),
               ("adaptive_clip", args.dp_adaptive_clip or None), ("weight_cap", args.dp_weight_cap))
               if value is not None}  # fmt: skip
    local = {key: value for key, value in (("max_grad_norm", args.ldp_clip), ("noise_multiplier", args.ldp_noise),
             ("target_epsilon", args.ldp_target_epsilon)) if value is not None}  # fmt: skip
    return SimSettings(
        agents=args.agents,
        rounds=args.rounds,
        partition=args.partition or ("shards" if args.command == "demo" and args.task == "classify" else ""),
        seed=args.seed,
        federation=args.federation,
        model=args.model or "",
        epochs=args.epochs,
        batch_size=args.batch_size or 0,
        lr=args.lr or 0.0,
        momentum=args.momentum,
        keep_momentum=args.keep_momentum,
        fraction=args.fraction,
        deadline_s=args.deadline,
        strategy=strategy,
        bounds=bounds,
        privacy=privacy,
        local_privacy=local,
        attackers=args.attackers,
        attack=args.attack or "",
        attack_scope=args.attack_scope,
        agents_per_process=args.agents_per_process,
        worker=args.worker,
        slow_agents=args.slow_agents,
        slowdown=args.slowdown,
        in_process=args.in_process,
        task=args.task,
        dataset=args.dataset or "",
        image_size=args.image_size,
        images_per_agent=args.images_per_agent,
        density_skew=args.density_skew,
        init_weights=args.init_weights or "",
        share=args.share,
        codec=args.codec,
        score_trained=args.score_trained,
        score_start=args.score_start,
        optimizer=args.optimizer,
        share_ratio=args.share_ratio,
        share_mode=args.share_mode,
        mode=args.mode,
        regions=args.regions,
        attack_regions=args.attack_regions,
        prometheus_port=args.prometheus_port,
        availability=args.availability,
        asynchronous=args.asynchronous,
        buffer=args.buffer,
        staleness=args.staleness,
        max_staleness=args.max_staleness,
        max_concurrent=args.max_concurrent,
    )


def run_sim_command(args: argparse.Namespace) -> int:
    """Refusals come before anything that changes the process (its loggers, its SIGTERM handler)."""
    from protocol.mqtt import BrokerSettings
    from sim.start_check import start_warnings

    if getattr(args, "config", None):
        return _run_experiment(Path(args.config), args.out)
    try:
        settings = _settings(args)
        if settings.in_process and args.broker:
            raise ValueError("--in-process uses no broker: drop --broker")
        if settings.regions and (args.broker or args.broker_cluster):
            raise ValueError("--regions starts its own bridged brokers: drop --broker and --broker-cluster")
        if args.broker and BrokerSettings.from_address(args.broker).fallbacks and settings.mode == "peer":
            raise ValueError("--mode peer takes one --broker HOST:PORT")  # (a malformed one fails here too)
        if args.broker_cluster:
            _check_cluster(args.broker_cluster, settings, args.broker)
    except ValueError as exc:
        print(f"skyfed {args.command}: {exc}", file=sys.stderr)
        return 2
    from sim.run import run_sim

    _take_over_process()
    print(
        f"SkyFed {args.command}: {settings.agents} agents, {settings.rounds} rounds, "
        f"{f'dataset {settings.dataset}, ' if settings.dataset else ''}model {settings.model}, "
        f"partition {settings.partition}, strategy {settings.strategy.get('name', 'default')}, seed {settings.seed}"
    )
    for warning in start_warnings(settings):
        print(f"warning: {warning}")
    progress = None
    if settings.mode == "client" and not settings.in_process and not settings.regions:  # agents as daemons
        from sim.progress import BarProgress, LineProgress

        progress = BarProgress(settings.agents) if sys.stdout.isatty() else LineProgress(settings.agents, print)
    try:
        result = run_sim(settings, Path(args.out), broker_address=args.broker, broker_cluster=args.broker_cluster,
                         progress=progress)  # fmt: skip
    except (OSError, RuntimeError) as exc:  # --out not a folder we can make; no broker at --broker
        print(f"skyfed {args.command}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # settings refused once the data is laid out (a --share-ratio that shares nothing)
        print(f"skyfed {args.command}: {exc}", file=sys.stderr)
        return 2
    privacy = result.metrics[-1].privacy if result.metrics else {}
    if settings.privacy and len(result.metrics) < settings.rounds:
        print(f"stopped after {len(result.metrics)} of {settings.rounds} rounds: the privacy budget is spent "
              f"(epsilon {privacy.get('epsilon')} of target {settings.privacy.get('target_epsilon')})")  # fmt: skip
    print("\n".join(summary_lines(result.out, result.metrics, result.final_eval, seconds=result.seconds,
                                   attackers=settings.attacker_names())))
    return 0


def _take_over_process() -> None:
    """A run prints its own lines (the MQTT and broker start-up logs are noise) and stops what it started on
    SIGTERM."""
    from protocol.daemon import quiet_connection_logs
    from sim.run import exit_on_sigterm

    quiet_connection_logs()
    exit_on_sigterm()


def _check_cluster(spec: str, settings, broker: str | None) -> None:  # noqa: ANN001 - a SimSettings
    """``--broker-cluster``: well-formed, and with neither --broker, --in-process nor peer mode."""
    from sim.nats_cluster import parse_cluster_spec

    parse_cluster_spec(spec)
    if broker or settings.in_process or settings.mode == "peer":
        raise ValueError("--broker-cluster starts the run's brokers for a client-mode run over MQTT: drop "
                         + ("--broker" if broker else "--in-process" if settings.in_process else "--mode peer"))


def _run_experiment(path: Path, out: str) -> int:
    from sim.experiment import load_experiment, run_experiment

    try:
        experiment = load_experiment(path)
    except (OSError, ValueError) as exc:
        print(f"skyfed sim: {exc}", file=sys.stderr)
        return 2
    _take_over_process()
    folder = Path(out if out != "runs/sim" else f"runs/{path.stem}")
    runs = len(experiment.conditions) * len(experiment.methods) * len(experiment.seeds)
    print(f"SkyFed experiment {experiment.title!r}: {runs} runs into {folder}/ (resumes if interrupted)")
    run_experiment(experiment, folder)
    print((folder / "results.md").read_text(), end="")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from sim.report import write_report

    path = Path(args.dir)
    if not path.is_file() and not (path / "metrics.jsonl").is_file():
        print(f"skyfed report: no {path / 'metrics.jsonl'}: give the folder of a run (its --out, or a server's "
              "state_dir) or a metrics file (an earlier run's, set aside as metrics-<UTC>.jsonl)", file=sys.stderr)
        return 2
    return 0 if write_report(path) else 1


def _add_sim_options(
    parser: argparse.ArgumentParser, *, agents: int, rounds: int, partition: str | None, out: str, federation: str
) -> None:
    from flcore.strategies import STRATEGIES
    from models.classify_data import DATASETS
    from models.partition import FORMS
    from protocol import codecs

    parser.add_argument("--agents", type=int, default=agents)
    parser.add_argument(
        "--mode", default="client", choices=("client", "peer"),
        help="client: a server aggregates (default); peer: no server, the agents federate among themselves "
        "(SmartFed's DFL; --strategy-option threshold=N is each peer's threshold, --deadline its round timeout)",
    )  # fmt: skip
    parser.add_argument(
        "--regions", type=int, default=0, metavar="R",
        help="two levels: R regional aggregators, each with its own mosquitto bridged to the root's, take part in "
        "the root's rounds as one participant each (region-1 ...); the agents are split between them",
    )  # fmt: skip
    parser.add_argument(
        "--attack-regions", type=int, default=0, metavar="K",
        help="with --regions: the first K regional aggregators are rogue and send their aggregate up as --attack "
        "makes it (region-1 ...)",
    )  # fmt: skip
    parser.add_argument(
        "--agents-per-process", type=int, default=1, metavar="K",
        help="host K agents in one OS process (each still its own MQTT connection, keys and state): PyTorch is "
        "loaded once per K agents, so 100 agents fit on a small machine",
    )  # fmt: skip
    parser.add_argument(
        "--worker", choices=("warm", "adaptive", "per-round", "deployed"), default="warm",
        help="each agent's training child (training.worker): warm (kept between rounds; the simulation default), "
        "adaptive (started when a round is announced, released after training.warm_idle_s idle), per-round "
        "(started for each round: a PyTorch start-up of seconds per agent per round), or deployed: whatever "
        "`skyfed agent run` uses by default (adaptive)",
    )  # fmt: skip
    parser.add_argument(
        "--in-process", action="store_true",
        help="no broker and no daemons: the real round engine and agents' trainers in this one process, for "
        "federations too large for this machine's daemons (e.g. 1000 agents; docs/results/privacy.md)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--task", default="classify", choices=["classify", "detect"],
                        help="classify: a CNN on --dataset; detect: YOLO on synthetic aerial images")  # fmt: skip
    parser.add_argument("--dataset", default=None, metavar="|".join(DATASETS.names()),
                        help=f"classify: {DATASETS.choices()} (default digits; what each is: skyfed data NAME --help); "
                        "each agent holds out 20 %% of its share as its local test split")  # fmt: skip
    parser.add_argument("--partition", default=partition,
                        help=f"classify: {FORMS} (default {partition or 'dirichlet:0.5'}; shards = shards:2); "
                        "detect: iid | class-skew:D (default class-skew:0.7)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=out, help="folder for metrics.jsonl, curves.png, global_model.safetensors "
                        "(a relative one is under the current folder)")  # fmt: skip
    parser.add_argument("--broker", default=None, help="HOST:PORT of an existing broker (default: start one); a "
                        "cluster's nodes comma-separated")  # fmt: skip
    parser.add_argument("--broker-cluster", default=None, metavar="nats:N",
                        help="start a local N-node NATS cluster (MQTT 3.1.1 + JetStream; Debian nats-server) and "
                        "spread the server and agents over its nodes, each with the others as fallbacks")  # fmt: skip
    parser.add_argument("--federation", default=federation)
    parser.add_argument("--model", default=None,
                        help="default: the dataset's (digits_cnn, mnist1d_cnn), yolo11n (detect)")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None, help="default: 32 (classify), 16 (detect)")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.05 (classify), 0.01 (detect)")
    parser.add_argument("--momentum", type=float, default=0.9, metavar="BETA",
                        help="agents' SGD momentum, in [0, 1) (default 0.9; 0: plain SGD)")  # fmt: skip
    parser.add_argument("--optimizer", default="sgd", metavar="sgd|adamw",
                        help="agents' local optimizer (training.optimizer): sgd with --momentum (default), or adamw "
                        "at --lr with torch's default weight decay")  # fmt: skip
    parser.add_argument("--share-ratio", type=float, default=0.0, metavar="R",
                        help="classify: carve R (in [0, 1)) of the agents' data into a pool the server trains on as "
                        "participant server-pool ([pool] data; seed 002: hybrid data sharing; 0: no pool)")  # fmt: skip
    parser.add_argument("--share-mode", default="share-disjoint", choices=["unify", "share-disjoint"],
                        help="with --share-ratio R: unify (floor(R*agents) agents drawn at random give all their "
                        "data and do not run) or share-disjoint (every agent gives floor(R*n) of its n samples; "
                        "default)")  # fmt: skip
    parser.add_argument("--keep-momentum", action="store_true",
                        help="agents carry their SGD momentum across rounds (training.keep_momentum)")  # fmt: skip
    parser.add_argument("--image-size", type=int, default=160, help="detect: image and model input size (pixels)")
    parser.add_argument("--images-per-agent", type=int, default=96, help="detect: synthetic training images per agent")
    parser.add_argument("--density-skew", type=float, default=0.0, metavar="S",
                        help="detect: agents' mean objects per image spread evenly over 6*(1-S) .. 6*(1+S), "
                        "S in [0, 1)")  # fmt: skip
    parser.add_argument("--share", default="full", choices=["full", "backbone", "head"],
                        help="detect: what is averaged; agents keep the rest local")  # fmt: skip
    parser.add_argument("--init-weights", default=None, metavar="FILE",
                        help="detect: start from a local Ultralytics .pt or an earlier run's "
                        "global_model.safetensors")  # fmt: skip
    parser.add_argument("--codec", default="fp32", metavar="|".join(codecs.spellings()),
                        help=f"how agents encode updates (server.codec): {codecs.choices()}; "
                        "docs/results/codecs.md")  # fmt: skip
    parser.add_argument("--score-trained", type=int, default=None, metavar="N",
                        help="the server scores at most N agents' trained models a round on its evaluation set "
                        "(server.score_trained; personal.trained.c_gen; 0: none; default 20, 0 for --task "
                        "detect)")  # fmt: skip
    parser.add_argument("--score-start", type=int, default=100, metavar="N",
                        help="the server scores at most N of the models agents started a round from besides the "
                        "published one (server.score_start; personal.c_gen; a sample when more differ)")  # fmt: skip
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="round deadline in seconds (default: 60, and 0.5 s per agent past 120 agents)")
    parser.add_argument(
        "--strategy", choices=STRATEGIES.names(), metavar="NAME",
        help=f"{' | '.join(STRATEGIES.names())} (default: auto, krum or centered-clip by how alike the updates are; "
        "fedavg with --task detect; docs/strategies.md says what each can do)",
    )  # fmt: skip
    parser.add_argument(
        "--strategy-option", action="append", default=[], metavar="KEY=VALUE", help="e.g. beta=0.2, f=2 (repeatable)"
    )
    parser.add_argument(
        "--bounds-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='[bounds] of server.toml, e.g. clip="off"',
    )
    dp = parser.add_argument_group("central differential privacy ([privacy] of server.toml; docs/privacy.md)")
    dp.add_argument("--dp-clip", type=float, metavar="S", help="clip every update to L2 norm S and add noise")
    dp.add_argument("--dp-noise", type=float, metavar="Z", help="noise multiplier z: noise std z*S on the sum")
    dp.add_argument("--dp-target-epsilon", type=float, metavar="E", help="stop selecting an agent before it passes E")
    dp.add_argument("--dp-delta", type=float, metavar="D", help="delta of the reported (epsilon, delta); default 1e-5")
    dp.add_argument("--dp-adaptive-clip", action="store_true",
                    help="start at --dp-clip and follow the median update norm (Andrew et al. 2021)")  # fmt: skip
    dp.add_argument("--dp-weight-cap", type=float, metavar="W",
                    help="with weighting=samples: an update counts min(samples / W, 1), summed over a fixed "
                         "denominator (DP-FedAvg with weights)")  # fmt: skip
    ldp = parser.add_argument_group("local differential privacy: DP-SGD on every agent ([privacy] of agent.toml)")
    ldp.add_argument("--ldp-noise", type=float, metavar="SIGMA", help="noise multiplier of each agent's DP-SGD")
    ldp.add_argument("--ldp-clip", type=float, metavar="C", help="per-sample gradient clip (default 1.0)")
    ldp.add_argument("--ldp-target-epsilon", type=float, metavar="E", help="an agent stops volunteering before E")
    parser.add_argument("--attackers", type=int, default=0, help="how many agents are malicious (real keys)")
    parser.add_argument(
        "--attack", default=None,
        help="sign-flip | scale:F | noise:SIGMA | samples:N | silent (trains, never sends); +samples:N may follow "
        "an attack on the weights (scale:-20+samples:1e12)"
    )
    parser.add_argument(
        "--attack-scope", default="parameters", choices=["parameters", "all"],
        help="attack the trainable parameters only (default) or every floating tensor (BatchNorm statistics too)",
    )  # fmt: skip
    parser.add_argument(
        "--slow-agents", type=int, default=0, metavar="N",
        help="N honest agents train --slowdown times slower (devices of unequal speed; see the threshold option)",
    )  # fmt: skip
    parser.add_argument("--slowdown", type=float, default=4.0, metavar="F", help="how many times slower (default 4)")
    parser.add_argument("--availability", default="", metavar="SPEC",
                        help="a fleet that comes and goes: flights:on=4m,off=20m[,jitter=1m] (each agent its own "
                             "phase) or a CSV of online intervals (agent,start_s,end_s); each agent's gate opens "
                             "and closes on it (docs/cli.md)")  # fmt: skip
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help='buffered asynchronous rounds ([rounds] mode = "async", FedBuff): a new model version '
                             "every --buffer updates, agents training whenever they are online; --rounds counts "
                             "buffers (docs/cli.md)")  # fmt: skip
    parser.add_argument("--buffer", type=int, default=10, metavar="K",
                        help="--async: updates per model version (default 10)")
    parser.add_argument("--staleness", default=DEFAULT_STALENESS, metavar="SPEC",
                        help="--async: weight of an update s versions behind: constant, polynomial:a (default "
                             f"{DEFAULT_STALENESS}) or hinge:a,b")  # fmt: skip
    parser.add_argument("--max-staleness", type=int, default=10, metavar="N",
                        help="--async: refuse an update more than N versions behind as stale (default 10)")
    parser.add_argument("--max-concurrent", type=int, default=0, metavar="N",
                        help="--async: at most N agents training at once (default 0: every agent online)")
    parser.add_argument("--prometheus-port", type=int, default=0, metavar="P",
                        help="serve the server's Prometheus metrics at http://127.0.0.1:P/metrics ([metrics] of "
                             "server.toml; docs/monitoring.md)")  # fmt: skip
    parser.set_defaults(handler=run_sim_command)


def add_sim_commands(commands: argparse._SubParsersAction) -> None:
    sim = commands.add_parser("sim", help="run a whole local federation over a real broker")
    _add_sim_options(sim, agents=4, rounds=5, partition=None, out="runs/sim", federation="sim")
    sim.add_argument(
        "--config", help="an experiment file (experiments/<name>.toml): run its whole grid and write results.md"
    )
    demo = commands.add_parser("demo", help="the sim with friendly defaults (digits CNN, 4 agents, non-IID)")
    _add_sim_options(demo, agents=4, rounds=10, partition="shards", out="runs/demo", federation="demo")
    demo.set_defaults(partition=None)  # "shards" for the digits demo, the task's default for detect
    report = commands.add_parser(
        "report", help="plot a run's metrics.jsonl: curves.png, agents.png and (with a privacy budget) privacy.png"
    )
    report.add_argument("dir", metavar="PATH", help="a run's folder, or one metrics file (metrics-<UTC>.jsonl)")
    report.set_defaults(handler=run_report)
