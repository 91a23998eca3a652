"""``[federation]`` of agent.toml: client mode (an edge agent of a server) or peer mode, and in peer mode the
round plan every peer must agree on, checked completely at start (an error names the key and the fix).

    [federation]
    mode = "peer"
    model = "digits_cnn"        # every peer builds the same start model from it and ``seed``
    # classes = ["car", ...]    # detectors (YOLO): the class names in id order, as in every peer's data.yaml
    # image_size = 160          # detectors: the training and validation input size in pixels
    # init_weights = "warm.pt"  # detectors: a start checkpoint instead of ``seed`` (the same file on every peer)
    rounds = 5
    threshold = 3               # peer updates (its own included) a peer waits for; capped at the current members
    round_timeout_s = 120.0     # then it aggregates what it has
    # late_weight = 0.71        # a member's late update of the round before joins the next at this weight (flcore.late)
    [federation.strategy]       # as server.toml's [strategy]; unset: the server's default, auto
    name = "auto"
    [federation.bounds]         # as server.toml's [bounds] (flcore.bounds)
    clip = "adaptive"
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

MODES = ("client", "peer")


@dataclass(frozen=True)
class FederationSection:
    mode: str = "client"
    model: str = ""
    num_classes: int = 10  # classifiers; a detector's follows ``classes``
    classes: list[str] = field(default_factory=list)  # detectors: class names in id order, as in data.yaml
    image_size: int = 640  # detectors: the square input size in pixels (a multiple of 32)
    init_weights: str = ""  # detectors: a local .pt or global_model.safetensors every peer starts from, as the server's
    rounds: int = 0
    threshold: int = 0
    round_timeout_s: float = 120.0
    late_weight: float | None = None  # None: flcore.late's default; 0: a late update is refused (flcore.late)
    join_wait_s: float = 3.0  # at start: how long retained memberships are gathered before the first round
    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0  # the shared start model's seed
    best_margin: float = 0.05  # BestAgg: a claimed best this much worse (headline score) on the own split is refused
    strategy: dict[str, Any] = field(default_factory=dict)
    bounds: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"federation.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "client":
            if any(getattr(self, f.name) != (f.default_factory() if f.default is MISSING else f.default)  # type: ignore[misc]
                   for f in fields(self)):  # fmt: skip
                raise ValueError('federation: the round plan keys are for mode = "peer"; in client mode the '
                                 "server sends the plan: remove them")  # fmt: skip
            return
        self._check_peer_plan()

    def _check_peer_plan(self) -> None:
        from models.tasks import task_of

        if not self.model:
            raise ValueError('federation.model is required with mode = "peer" (e.g. model = "digits_cnn")')
        try:
            task_of(self.model)
        except ValueError as exc:
            raise ValueError(f"federation.{exc}") from None
        checks = (
            ("rounds", self.rounds >= 1, "a whole number >= 1"),
            ("threshold", self.threshold >= 1, "a whole number >= 1 (SmartFed's static threshold: how many peer "
             "updates, its own included, a peer waits for; set it to the number of peers to wait for all)"),
            ("round_timeout_s", self.round_timeout_s > 0, "> 0 seconds"),
            ("join_wait_s", self.join_wait_s >= 0, ">= 0 seconds"),
            ("epochs", self.epochs >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("lr", self.lr > 0, "> 0"),
            ("momentum", 0 <= self.momentum < 1, "in [0, 1)"),
            ("num_classes", self.num_classes >= 2, ">= 2"),
            ("best_margin", self.best_margin >= 0, ">= 0"),
        )  # fmt: skip
        for key, ok, what in checks:
            if not ok:
                raise ValueError(f"federation.{key} must be {what}, got {getattr(self, key)!r}")
        self._check_detector()
        self.fold_weight()
        self.build_strategy()
        self.influence_policy()

    def _check_detector(self) -> None:
        """A detector's classes (its ``num_classes`` follows them) and input size; a classifier has neither."""
        from models.tasks import task_of

        if task_of(self.model) != "detect":
            if self.classes or self.init_weights:
                raise ValueError(f"federation.classes and init_weights are for detector models; {self.model} is a "
                                 "classifier: remove them")  # fmt: skip
            return
        if not self.classes or len(set(self.classes)) != len(self.classes) or not all(
                isinstance(c, str) and c for c in self.classes):  # fmt: skip
            raise ValueError(f"federation.classes must name the distinct classes of detector {self.model} in id order, "
                             f'as in every peer\'s data.yaml (e.g. classes = ["car", "truck"]), got {self.classes!r}')
        if self.image_size < 32 or self.image_size % 32:
            raise ValueError(f"federation.image_size must be a multiple of 32 (YOLO's stride), got {self.image_size}")
        object.__setattr__(self, "num_classes", len(self.classes))

    def build_strategy(self):  # noqa: ANN201 - flcore's Strategy, imported here only
        """A fresh strategy from ``[federation.strategy]`` (its errors name the key); whether peers can run it,
        and with this model's task, the strategy declares (``flcore.strategies.capabilities``)."""
        from flcore.strategies import STRATEGIES, build_strategy
        from flcore.strategies.capabilities import refusal, task_refusal
        from models.tasks import task_of

        table = dict(self.strategy)  # no name: the server's measured default (``flcore.strategies.choice``)
        for key in ("threshold", "elect_best", "late_weight"):
            if key in table:
                raise ValueError(f"federation.strategy.{key} is a server setting: use federation.threshold and "
                                 "federation.late_weight (peers always elect the best model at the end)")  # fmt: skip
        try:
            strategy = build_strategy(table)
        except ValueError as exc:
            raise ValueError(f"federation.{exc}") from None
        if why := refusal(strategy.peers, "between peers"):
            raise ValueError(f"federation.strategy.name {strategy.name!r} does not work between peers: {why}; choose "
                             f"one of {', '.join(STRATEGIES.where(lambda kind: kind.peers is True))}")  # fmt: skip
        if why := task_refusal(type(strategy), task_of(self.model)):
            raise ValueError(f"federation.strategy.name: {why}")
        return strategy

    def fold_weight(self) -> float:
        """The weight factor of a member's late update of the round before, folded into this peer's next round."""
        from flcore.late import late_weight

        return late_weight(self.late_weight, self.threshold, where="federation.late_weight")

    def influence_policy(self):  # noqa: ANN201
        from flcore.bounds import InfluencePolicy
        from protocol.typed import SchemaError, build

        try:
            return build(InfluencePolicy, self.bounds, where="bounds", strict=True)
        except (SchemaError, ValueError) as exc:
            raise ValueError(f"federation.{exc}") from None

