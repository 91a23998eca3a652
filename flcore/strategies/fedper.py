"""FedPer [Arivazhagan, Aggarwal, Singh & Choudhary 2019, "Federated Learning with Personalization Layers",
https://arxiv.org/abs/1912.00818].

A model is a shared body (base layers) and a personal head (personalization layers). Every agent trains both
together on its own data each round; the body is averaged by FedAvg, the head stays on the agent.

- **Which layers are the head:** ``head_layers`` = k: the model's last k layers with a ``weight``, in state_dict
  order, each of which must be a Linear layer (a 2-D weight and at most a bias); their tensors are the head, the
  rest the body. k = 1 (the default) is the classifier layer alone. Module order is the built model's (a
  published model lists its tensors by name), so the server derives the names from its own build when it starts
  (``fit_model``) and each agent from the network it trains. A k that reaches a convolution or BatchNorm, or that
  leaves no body, is refused at the server's start and by every agent (the recipe declines the round), naming
  the key.
- **The agent** (``participant.recipes.fedper``) keeps its head in its state folder, loads it over the round's
  global body before it trains, and measures its C-SPE with it (the model it would use now); after training it
  keeps the trained head and puts the round's head back into the model it uploads, so the update's head change
  is exactly zero: the head never leaves the agent.
- **The server** averages the body as FedAvg does (same weighting, bounds and DP sensitivity) and keeps the head
  positions of the global model as they were, whatever an update claims there: an agent that does not follow the
  recipe cannot move them. The published global model is the averaged body with the *initial* head: the server
  never holds a trained head, and averaging the agents' heads would send them off the agents, which is what
  FedPer keeps private. An agent that joins later starts its head from that initial head (the paper's random
  initialization of the personalization layers).
- **Scores:** agents are judged by their own body + head (``models = "agent"``, C-SPE leads). The server holds no
  personal head, so there is no C-GEN of the agents' models (``broker_server.rounds.engine``'s ``judged_here``, as
  for Ditto); its evaluation of the global model (body + initial head) is shown beside C-SPE, labelled global,
  and is no classifier anyone uses: it cannot screen a small round's updates nor roll a round back as collapsed
  (``personal_part``), and ``elect_best`` is refused.
- **Under central DP** the release is FedAvg's average of clipped updates with its noise; the head positions are
  then reset (post-processing, ``server_step``). As for Ditto, the agents' C-SPE is not published under central DP.
  Under local DP-SGD body and head train privately; the head stays on the agent.
- **Peers** are refused: a peer judges and elects models on its own validation split, and the shared model has
  no trained head to judge. **Detectors** are refused: their trainer keeps a private part with ``server.share``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from flcore.strategies.base import Contribution, RoundResult, TrainPlan, asking
from flcore.strategies.fedavg import FedAvg, FedAvgOptions
from models.weights import TensorSpec
from protocol.messages import TrainSettings


@dataclass(frozen=True)
class FedPerOptions(FedAvgOptions):
    head_layers: int = 1  # the model's last Linear layers that stay on each agent

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.head_layers, bool) or not isinstance(self.head_layers, int) or self.head_layers < 1:
            raise ValueError(f"strategy.head_layers must be a whole number >= 1 (the last Linear layers each agent "
                             f"keeps; 1 = the classifier layer), got {self.head_layers!r}")  # fmt: skip


def personal_head(shapes: Iterable[tuple[str, tuple[int, ...]]], layers: int) -> tuple[str, ...]:
    """The state_dict names of the last ``layers`` layers with a weight (``shapes``: name and shape, in state_dict
    order); ``ValueError`` naming ``strategy.head_layers`` when one of them is not a Linear layer or no body is left."""
    modules: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in shapes:
        modules.setdefault(name.rpartition(".")[0], []).append((name.rpartition(".")[2], tuple(shape)))
    layered = [m for m, tensors in modules.items() if any(t == "weight" for t, _ in tensors)]
    linear = 0
    for module in reversed(layered):
        if not _is_linear(modules[module]):
            break
        linear += 1
    most = min(linear, len(layered) - 1)
    fix = ("choose a model that ends in a Linear layer" if most < 1 else "choose head_layers = 1" if most == 1
           else f"choose head_layers between 1 and {most}")  # fmt: skip
    if layers >= len(layered):
        raise ValueError(f"strategy.head_layers = {layers}: the model has {len(layered)} layers with weights and the "
                         f"head must leave a shared body: {fix}")  # fmt: skip
    if layers > linear:
        raise ValueError(f"strategy.head_layers = {layers}: layer {layered[-layers]!r} is not a Linear layer (a 2-D "
                         f"weight and a bias), and the head is the model's last Linear layers: {fix}")  # fmt: skip
    return tuple(f"{m}.{t}" if m else t for m in layered[-layers:] for t, _ in modules[m])


def _is_linear(tensors: list[tuple[str, tuple[int, ...]]]) -> bool:
    named = dict(tensors)
    return len(named.get("weight", ())) == 2 and set(named) <= {"weight", "bias"}


def head_mask(spec: tuple[TensorSpec, ...], names: tuple[str, ...]) -> np.ndarray:
    """True at the positions of the flat float vector (``models.weights.flatten`` layout) that hold ``names``."""
    sizes = [int(np.prod(s.shape, dtype=np.int64)) for s in spec]
    return np.repeat([s.name in names for s in spec], sizes).astype(bool)


class FedPer(FedAvg):
    name = "fedper"
    Options = FedPerOptions
    models = "agent"
    personal_part = "the personal head stays on each agent"
    peers = "a peer judges and elects models on its own validation split, and the shared body has no trained head"
    tasks = frozenset({"classify"})
    why_not_tasks = "keeps Linear head layers on each classifier agent; detectors keep a part with server.share"

    def __init__(self, options: FedPerOptions | None = None) -> None:
        super().__init__(options)
        self._head = np.zeros(0, bool)
        self._names: tuple[str, ...] = ()

    def configure_train(self, settings: TrainSettings, round_number: int, paces: dict[str, float]) -> TrainPlan:
        return TrainPlan(asking(settings, "fedper", layers=self.options.head_layers))

    def fit_model(self, layout: Callable[[], tuple[TensorSpec, ...]]) -> str:
        """The head's tensor names, from the model's module order (what ``begin`` keeps as it was)."""
        try:
            self._names = personal_head(((s.name, s.shape) for s in layout()), self.options.head_layers)
        except ValueError as exc:
            return str(exc)
        return ""

    def run_problem(self, rounds: int) -> str:
        if self.elect_best:
            return ("strategy.elect_best publishes the global model that evaluated best, and fedper's global model "
                    "carries no trained head (each agent keeps its own): remove elect_best")  # fmt: skip
        return ""

    def begin(self, global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:
        super().begin(global_vector, spec)
        assert self._names, "fit_model names the head before the first round"
        self._head = head_mask(spec, self._names)

    def average(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        """FedAvg of the whole deltas: what central DP noises (the head's part is dropped in ``server_step``)."""
        return super().aggregate(global_vector, contributions)

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        return self.server_step(global_vector, self.average(global_vector, contributions))

    def server_step(self, global_vector: np.ndarray, averaged: RoundResult) -> RoundResult:
        """The averaged body, and the global model's head as it was."""
        new = averaged.global_vector.copy()
        new[self._head] = global_vector[self._head]
        return RoundResult(new, {**averaged.detail, "personal_head": list(self._names)})
