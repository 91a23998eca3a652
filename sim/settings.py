"""What a local federation is asked to be (``skyfed sim``'s flags, ``skyfed.api``): ``SimSettings``, checked as
a whole when made, so that a bad combination fails before anything is written or started, naming the flag.
``sim.federation`` and ``sim.peer_federation`` lay it out on disk.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flcore.staleness import DEFAULT_STALENESS
from models import partition
from models.classify_data import classify_data
from models.own import is_reference
from models.synthetic_detection import NAMES
from sim.scale import round_deadline_s
from sim.start_check import check_read

# what an unset model, partition, batch size or learning rate means for each task
TASK_DEFAULTS = {
    "classify": {"model": "digits_cnn", "partition": "dirichlet:0.5", "batch_size": 32, "lr": 0.05},
    "detect": {"model": "yolo11n", "partition": "class-skew:0.7", "batch_size": 16, "lr": 0.01},
}


@dataclass(frozen=True)
class SimSettings:
    agents: int = 4
    rounds: int = 5
    partition: str = ""  # "": the task's default (TASK_DEFAULTS)
    seed: int = 0
    federation: str = "sim"
    model: str = ""
    epochs: int = 2
    batch_size: int = 0
    lr: float = 0.0
    momentum: float = 0.9
    keep_momentum: bool = False  # training.keep_momentum: agents carry their SGD momentum across rounds
    fraction: float = 1.0
    deadline_s: float = 0.0  # 0: sim.scale.round_deadline_s, 60 s up to 120 agents
    strategy: dict[str, Any] = field(default_factory=dict)  # {} = the server default
    bounds: dict[str, Any] = field(default_factory=dict)
    attackers: int = 0
    attack: str = ""
    attack_scope: str = "parameters"
    agents_per_process: int = 1  # K agents share one OS process (sim.agent_host); 1 = one process each
    worker: str = "warm"  # training.worker of every agent (agent.runner); "deployed": unset, the agent's default
    privacy: dict[str, Any] = field(default_factory=dict)  # [privacy] of server.toml (central DP); {} = off
    local_privacy: dict[str, Any] = field(default_factory=dict)  # [privacy] of every agent.toml (DP-SGD); {} = off
    slow_agents: int = 0  # how many honest agents train ``slowdown`` times slower (sim.slow)
    slowdown: float = 4.0
    in_process: bool = False  # no broker, no daemons: the round engine and trainers in one process (sim.inprocess)
    task: str = "classify"  # classify: ``dataset``; detect: YOLO on synthetic aerial images (sim.detection_data)
    dataset: str = ""  # classify: digits (""), mnist1d (models.classify_data); its model unless ``model`` is set
    image_size: int = 160  # detect: image and model input size in pixels
    images_per_agent: int = 96  # detect: training images per agent
    density_skew: float = 0.0  # detect: agents' objects per image spread over 6·(1 ± S) (sim.detection_data)
    pooled: bool = False  # detect: one agent trains on the union of the ``agents`` shares (centralized baseline)
    share: str = "full"  # detect: server.share, what is averaged (full, backbone or head)
    init_weights: str = (
        ""  # detect: server.init_weights, a start checkpoint (.pt or an earlier global_model.safetensors)
    )
    codec: str = "fp32"  # server.codec: how agents encode updates (protocol.codecs)
    score_trained: int | None = None  # server.score_trained: uploads a round whose trained model it scores (C-GEN)
    score_start: int = 100  # server.score_start: start models a round it scores besides the published one (C-GEN)
    optimizer: str = "sgd"  # training.optimizer: the agents' (and the pool's) local optimizer, sgd or adamw
    share_ratio: float = 0.0  # seed 002: the share of the data carved out into the server's pool (0: no pool)
    share_mode: str = "share-disjoint"  # how (models.partition.share): unify | share-disjoint
    regions: int = 0  # R > 0: R regional aggregators under a root, each with its own bridged broker (sim.region_run)
    attack_regions: int = 0  # with regions: the first K regional aggregators send --attack up (sim.rogue_region)
    mode: str = "client"  # "peer": no server, the agents federate among themselves (sim.peer_run, agent.peer)
    prometheus_port: int = 0  # the server's [metrics] prometheus_port (0: no endpoint)
    availability: str = ""  # every agent's [gate] availability trace (sim.availability); "": always there
    asynchronous: bool = False  # --async: [rounds] mode = "async", a model version every ``buffer`` updates
    buffer: int = 10  # rounds.buffer
    staleness: str = DEFAULT_STALENESS  # rounds.staleness (flcore.staleness)
    max_staleness: int = 10  # rounds.max_staleness
    max_concurrent: int = 0  # rounds.max_concurrent (0: every agent online)

    def __post_init__(self) -> None:
        from agent.config import WORKERS
        from broker_server.privacy.policy import PrivacyPolicy
        from flcore.bounds import InfluencePolicy
        from flcore.strategies import build_strategy
        from flcore.strategies.capabilities import refusal, task_refusal
        from models.tasks import task_of
        from models.zoo import input_shape
        from participant.local_dp import LocalPrivacySection
        from protocol.codecs import Codec, CodecError
        from protocol.messages import TrainSettings
        from protocol.typed import build
        from sim.attacks import SCOPES, Attack
        from sim.detection_data import class_probs, densities

        if self.task not in TASK_DEFAULTS:
            raise ValueError(f"--task must be one of {', '.join(TASK_DEFAULTS)}, got {self.task!r}")
        check_read(self, {"deadline_s": round_deadline_s(self.agents)})
        if self.task == "classify":
            self._default_dataset_and_model()
        elif self.dataset:
            raise ValueError(f"--dataset {self.dataset} is for --task classify; --task detect trains on synthetic "
                             "aerial images: drop --dataset")  # fmt: skip
        if not self.deadline_s:
            object.__setattr__(self, "deadline_s", round_deadline_s(self.agents))
        for key, value in TASK_DEFAULTS[self.task].items():
            if not getattr(self, key):
                object.__setattr__(self, key, value)
        if self.task == "detect" and "name" not in self.strategy:  # object-weighted FedAvg, as the results measure
            object.__setattr__(self, "strategy", {"name": "fedavg", **self.strategy})
        if is_reference(self.model):  # the operator's own classifier (models.own): checked once, naming the flag
            from models.own import check_own_model

            check_own_model(self.model, 10, "--model")  # both datasets have 10 classes
        if task_of(self.model) != self.task:
            raise ValueError(f"--model {self.model} is not a {self.task} model (--task {self.task})")
        if self.task == "classify" and input_shape(self.model) != (data := classify_data(self.dataset)).sample_shape:
            raise ValueError(f"--model {self.model} takes samples of shape {input_shape(self.model)}, --dataset "
                             f"{self.dataset} has {data.sample_shape}: use --model {data.model}")  # fmt: skip
        if self.agents < 1:
            raise ValueError(f"--agents must be >= 1, got {self.agents}")
        if self.worker not in (*WORKERS, "deployed"):
            raise ValueError(f"--worker must be one of {', '.join((*WORKERS, 'deployed'))}, got {self.worker!r}")
        if self.agents_per_process < 1:
            raise ValueError(f"--agents-per-process must be >= 1, got {self.agents_per_process}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1) (0: plain SGD), got {self.momentum}")
        if not 0 <= self.attackers < self.agents:
            raise ValueError(
                f"--attackers must be between 0 and --agents - 1 ({self.agents - 1}), got {self.attackers}"
            )
        if not 0 <= self.slow_agents <= self.agents - self.attackers:
            raise ValueError(
                f"--slow-agents must be between 0 and the number of honest agents ({self.agents - self.attackers}), "
                f"got {self.slow_agents}"
            )
        if self.slowdown < 1:
            raise ValueError(f"--slowdown must be >= 1 (how many times slower), got {self.slowdown}")
        if self.attackers and not self.attack:
            raise ValueError("--attackers needs --attack KIND (sign-flip, scale:F, noise:SIGMA, samples:N or silent)")
        if self.attack and not self.attackers and not self.attack_regions:
            raise ValueError(f"--attack {self.attack} needs --attackers N: how many of the {self.agents} agents "
                             "attack (or, with --regions, --attack-regions K)")  # fmt: skip
        if self.attack_regions and not self.regions:
            raise ValueError("--attack-regions K needs --regions R: the first K regional aggregators attack their root")
        if self.attack:
            Attack.parse(self.attack)
        if self.availability:
            from sim.availability import absolute_spec, check_spec

            object.__setattr__(self, "availability", absolute_spec(self.availability))
            check_spec(self.availability, agent_names(1 if self.pooled else self.running_agents))
        self._check_async()
        if self.in_process and self.slow_agents:
            raise ValueError("--in-process runs its agents at one speed (no deadlines): drop --slow-agents")
        if self.regions:
            self._check_regions()
        if self.mode == "peer":
            self._check_peer_mode()
        elif self.mode != "client":
            raise ValueError(f"--mode must be client or peer, got {self.mode!r}")
        if self.prometheus_port:
            self._check_prometheus()
        if self.attack_scope not in SCOPES:
            raise ValueError(f"--attack-scope must be one of {', '.join(SCOPES)}, got {self.attack_scope!r}")
        if self.task == "detect":
            class_probs(self.partition, 0, self.agents)
            densities(self.agents, self.density_skew)
            if self.init_weights and not Path(self.init_weights).is_file():
                raise ValueError(f"--init-weights {self.init_weights}: no such file")
            if self.pooled and (self.slow_agents or self.fraction < 1):
                raise ValueError("pooled runs one agent: drop --slow-agents and --fraction")
            if self.attackers or self.local_privacy:
                raise ValueError("--task detect runs honest agents without local DP: drop --attackers and --ldp-*")
        else:
            partition.parse_plan(self.partition)
            if self.pooled:
                raise ValueError("pooled (one agent holding every share) exists for --task detect only")
        try:
            Codec.parse(self.codec)
        except CodecError as exc:
            raise ValueError(f"--codec: {exc}") from None
        self._check_sharing()
        TrainSettings(optimizer=self.optimizer, keep_momentum=self.keep_momentum)  # names a bad --optimizer
        bounds = build(InfluencePolicy, self.bounds, where="bounds", strict=True)
        privacy = build(PrivacyPolicy, self.privacy, where="privacy", strict=True)
        strategy = build_strategy(privacy.strategy_table(self.strategy)[0])
        privacy.check_compatible(self.strategy, bounds)
        if why := task_refusal(type(strategy), self.task):
            raise ValueError(f"--task {self.task}: {why}")
        if problem := strategy.run_problem(self.rounds):
            raise ValueError(f"--rounds {self.rounds}: {problem} (--strategy-option after=N)")
        local_dp = build(LocalPrivacySection, self.local_privacy, where="local_privacy", strict=True).enabled
        if local_dp and (why := refusal(strategy.local_dp, "with local DP-SGD")):
            raise ValueError(f"--strategy {strategy.name} with local DP: {why}: drop --ldp-*")

    def _check_sharing(self) -> None:
        """--share-ratio and --share-mode: a pool carved out of a classify task's partition, leaving agents to run
        (a ratio below 1 leaves unify at least one agent: ⌊R·N⌋ < N)."""
        if self.share_mode not in partition.SHARE_MODES:
            raise ValueError(f"--share-mode must be one of {', '.join(partition.SHARE_MODES)}, got {self.share_mode!r}")
        if not 0 <= self.share_ratio < 1:
            raise ValueError(f"--share-ratio must be in [0, 1) (the share of the data given to the server's pool; "
                             f"1 would leave the agents nothing), got {self.share_ratio}")  # fmt: skip
        if self.share_ratio and self.task != "classify":
            raise ValueError("--share-ratio needs --task classify (the pool is a classifier .npz)")
        if self.attackers >= self.running_agents:
            raise ValueError(f"--attackers must be below the {self.running_agents} agents that still run after "
                             f"--share-mode unify, got {self.attackers}")  # fmt: skip

    @property
    def running_agents(self) -> int:
        """The agents that run: all of them, less those whose whole share went into the pool (unify)."""
        return self.agents - (int(self.share_ratio * self.agents) if self.share_mode == "unify" else 0)

    def _check_async(self) -> None:
        """The buffer's flags need ``--async``; with it, ``[rounds]`` must accept them (``RoundRules``)."""
        from flcore.rounds import RoundRules

        table = self.async_table()
        if not self.asynchronous:
            if changed := [k for k, v in table.items() if getattr(RoundRules, k) != v]:
                raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in changed)} needs --async: "
                                 "synchronous rounds have no buffer")  # fmt: skip
            return
        try:
            RoundRules(mode="async", **table)
        except ValueError as exc:
            raise ValueError(str(exc).replace("rounds.", "--").replace("_", "-")) from None
        if self.buffer > self.running_agents:
            raise ValueError(f"--buffer {self.buffer} is more than the {self.running_agents} agents: a buffer of K "
                             "takes K updates, one per agent")  # fmt: skip

    def async_table(self) -> dict[str, Any]:
        """``[rounds]``'s asynchronous keys as the flags set them (``mode`` aside)."""
        return {"buffer": self.buffer, "staleness": self.staleness, "max_staleness": self.max_staleness,
                "max_concurrent": self.max_concurrent}  # fmt: skip

    def _check_regions(self) -> None:
        if not 1 <= self.regions <= self.running_agents:
            raise ValueError(f"--regions must be between 1 and the {self.running_agents} agents, got {self.regions}")
        if not 0 <= self.attack_regions < self.regions:
            raise ValueError(f"--attack-regions must be between 0 and --regions - 1 ({self.regions - 1}), got "
                             f"{self.attack_regions}")  # fmt: skip
        if self.attack_regions and (not self.attack or self.attack == "silent"):
            raise ValueError("--attack-regions K needs --attack KIND (sign-flip, scale:F, noise:SIGMA or samples:N, "
                             "+samples:N may follow): what the rogue regions send up")  # fmt: skip

    def _check_prometheus(self) -> None:
        """``--prometheus-port``: the server's endpoint, so a run must have a server daemon."""
        if not 1 <= self.prometheus_port <= 65535:
            raise ValueError(f"--prometheus-port must be 1-65535, got {self.prometheus_port}")
        if self.in_process or self.mode == "peer":
            flag = "--in-process" if self.in_process else "--mode peer"
            raise ValueError(f"--prometheus-port serves the server's metrics; {flag} runs no server daemon: drop it")

    def _check_peer_mode(self) -> None:
        """What a peer-mode run cannot do (yet): say so now, naming the flag."""
        if self.attack == "silent":
            raise ValueError("--attack silent is not available with --mode peer: drop it")
        if "elect_best" in self.strategy:
            raise ValueError("--strategy-option elect_best is not available with --mode peer: peers always elect the "
                             "best model at the end (BestAgg); drop it")  # fmt: skip
        from agent.peer.plan import FederationSection

        FederationSection(**peer_plan(self))  # the peers' plan, checked as each peer checks it at start

    def _default_dataset_and_model(self) -> None:
        """An unset dataset is digits, an unset model the dataset's own."""
        data = classify_data(self.dataset or "digits")
        object.__setattr__(self, "dataset", data.name)
        object.__setattr__(self, "model", self.model or data.model)

    def attacker_names(self) -> list[str]:
        """Which agents attack: a reproducible draw from the seed."""
        return sorted(random.Random(self.seed).sample(agent_names(self.running_agents), self.attackers))

    def slow_names(self) -> list[str]:
        """Which honest agents are slow: a reproducible draw from the seed."""
        honest = [name for name in agent_names(self.running_agents) if name not in self.attacker_names()]
        return sorted(random.Random(f"{self.seed}-slow").sample(honest, self.slow_agents))


def agent_names(count: int) -> list[str]:
    return [f"agent-{i:02d}" for i in range(1, count + 1)]


PEER_JOIN_WAIT_S = 3.0


def peer_plan(settings: SimSettings) -> dict:
    """``[federation]`` of every peer's agent.toml: the round plan they share. The strategy's ``threshold``
(``--strategy-option threshold=N``) is the peers' threshold (default: every peer), its ``late_weight`` theirs too;
``--deadline`` their ``round_timeout_s``."""
    return {
        "mode": "peer",
        "model": settings.model,
        "rounds": settings.rounds,
        "threshold": settings.strategy.get("threshold") or settings.agents,
        **({"late_weight": settings.strategy["late_weight"]} if "late_weight" in settings.strategy else {}),
        "round_timeout_s": settings.deadline_s,
        "join_wait_s": PEER_JOIN_WAIT_S,
        "epochs": settings.epochs,
        "batch_size": settings.batch_size,
        "lr": settings.lr,
        "momentum": settings.momentum,
        "seed": settings.seed,
        **({"classes": list(NAMES), "image_size": settings.image_size} if settings.task == "detect" else {}),
        **({"init_weights": str(Path(settings.init_weights).resolve())} if settings.init_weights else {}),
        "strategy": {k: v for k, v in settings.strategy.items() if k not in ("threshold", "elect_best", "late_weight")},
        "bounds": settings.bounds,
    }
