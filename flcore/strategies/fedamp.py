"""FedAMP: attentive message passing for personalized federated learning (Huang et al., "Personalized
Cross-Silo Federated Learning on Non-IID Data", AAAI 2021, arXiv:2007.03797) — the strongest baseline of
seed 003.

Every agent keeps its own model wᵢ. After each round the server builds, for every agent, its **cloud
model** uᵢ = Σⱼ ξᵢⱼ·wⱼ, which weights the other agents' models by how close they are to its own, and seals
uᵢ to agent i alone. ``start`` says what the agent trains from, always with the proximal term
(λ/αₖ)/2·‖w − uᵢ‖² (the paper's client step argmin Fᵢ(w) + λ/(2αₖ)·‖w − uᵢ‖²):

- ``"own"``, the paper's form and PFLlib's (``clientamp``: the client's model is never overwritten, uᵢ only
  enters the proximal term): the agent goes on from its own wᵢ (no download when the server's copy is its own)
  and uᵢ comes beside it as a one-model bundle (``Assignment.peers``), which the ``proximal`` recipe with
  ``toward = "peer"`` pulls toward. Only the bundle's dithered copy of uᵢ leaves the server, so uᵢ is kept
  named at random, not fingerprinted (``ModelBank.writer``). Its C-SPE, the start model's, is then wᵢ, the
  model PFLlib evaluates.
- ``"cloud"``: the agent starts from uᵢ itself (FedProx's ``prox_mu`` toward the start model), SkyFed's
  first form; its C-SPE is uᵢ's.

``attention = "distance"`` is the paper's message passing with A(x) = 1 − e^(−x/σ): ξᵢⱼ = αₖ·A′(‖wᵢ − wⱼ‖²)
= αₖ·e^(−‖wᵢ − wⱼ‖²/σ)/σ for j ≠ i and ξᵢᵢ = 1 − Σⱼ ξᵢⱼ (as the PFLlib reimplementation computes it).
``"cosine"`` is the paper's HeurFedAMP for deep networks: ξᵢᵢ = ``self_weight`` and the others share the
rest by a softmax of σ·cos(wᵢ, wⱼ). The mean of the agents' models is published as the global model, so
FedAMP's curves share FedAvg's scale (seed 003 reports global accuracy too).

Choices where the paper leaves room: if the distance weights of the others sum past 1 − ``self_weight``
(models far closer than σ: with the defaults, MNIST-1D CNNs are), they are scaled to sum to that, so uᵢ
stays an average of models and keeps at least ``self_weight`` of the agent's own (the first version
scaled them to 1: every agent then started from the mean of the others', never its own). The proximal term
is the paper's squared norm (PFLlib adds the norm itself, unsquared). Memory: the Gram matrix (8·n² bytes)
and two column chunks of the cloud models as they are written (``mixing.keep_mixed``, 128 MB at most); the
models stay on disk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from flcore.agent_models import Assignment
from flcore.strategies.base import (
    KEPT_MODELS_NOT_PEERS,
    Contribution,
    KeptModels,
    RoundResult,
    StartPlan,
    Strategy,
    TrainPlan,
    asking,
)
from flcore.strategies.demlearn import distance_matrix
from flcore.strategies.krum import mean_and_gram, squared_distances
from flcore.strategies.mixing import keep_mixed
from protocol.messages import TrainSettings

ATTENTIONS = ("distance", "cosine")
STARTS = ("own", "cloud")


@dataclass(frozen=True)
class FedAMPOptions:
    alpha_k: float = 1.0  # αₖ, the server's step (the paper's and the Flower baseline's default)
    lam: float = 1.0  # λ: the agent's proximal weight toward its cloud model is λ/αₖ
    sigma: float = 1.0  # σ: the attention's scale
    attention: str = "distance"
    self_weight: float = 0.5  # cosine attention: ξᵢᵢ; distance attention: the least ξᵢᵢ
    start: str = "own"  # what an agent trains from: its own wᵢ pulled toward uᵢ (the paper's), or uᵢ

    def __post_init__(self) -> None:
        for key in ("alpha_k", "sigma"):
            if not getattr(self, key) > 0:
                raise ValueError(f"strategy.{key} must be > 0, got {getattr(self, key)}")
        if self.lam < 0:
            raise ValueError(f"strategy.lam must be >= 0 (0: no proximal term), got {self.lam}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"strategy.attention {self.attention!r} must be one of {', '.join(ATTENTIONS)}")
        if not 0 <= self.self_weight <= 1:
            raise ValueError(f"strategy.self_weight must be in [0, 1], got {self.self_weight}")
        if self.start not in STARTS:
            raise ValueError(f"strategy.start {self.start!r} must be one of {', '.join(STARTS)} (own: the "
                             "paper's form, each agent trains on from its own model pulled toward its cloud model)")


def attention_weights(gram: np.ndarray, options: FedAMPOptions) -> np.ndarray:
    """ξ: row i holds the weights of every agent's model in agent i's cloud model (rows sum to 1)."""
    n = len(gram)
    if n == 1:
        return np.ones((1, 1))
    others = ~np.eye(n, dtype=bool)
    if options.attention == "cosine":
        logits = np.where(others, options.sigma * (1 - distance_matrix(gram, "cosine")), -np.inf)
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        xi = (1 - options.self_weight) * weights / weights.sum(axis=1, keepdims=True)
    else:
        xi = np.where(others, options.alpha_k * np.exp(-squared_distances(gram) / options.sigma) / options.sigma, 0)
        total, room = xi.sum(axis=1, keepdims=True), 1 - options.self_weight
        xi = np.where(total > room, xi * (room / np.maximum(total, 1e-300)), xi)  # the own model keeps self_weight
    return xi + np.diag(1 - xi.sum(axis=1)) + 0.0  # + 0.0: no -0.0 in the metrics


class FedAMP(Strategy):
    name = "fedamp"
    Options = FedAMPOptions
    keeps_models = True
    models = "agent"
    peers = KEPT_MODELS_NOT_PEERS
    why_not_private = "each agent receives its cloud model, a mix of the other agents' models, un-noised"
    tasks = frozenset({"classify"})
    why_not_tasks = "needs a proximal term toward each agent's cloud model, which the detector trainer does not have"

    def configure_train(self, settings: TrainSettings, round_number: int, paces: dict[str, float]) -> TrainPlan:
        mu = self.options.lam / self.options.alpha_k
        if self.options.start == "own":
            return TrainPlan(asking(settings, "proximal", mu=mu, toward="peer"))
        return TrainPlan(asking(settings, "proximal", mu=mu))

    def action(self, round_number: int) -> str:
        return "personal"

    def __init__(self, options: FedAMPOptions | None = None) -> None:
        super().__init__(options)
        self.gram: tuple[list[str], np.ndarray] = ([], np.zeros((0, 0)))  # this round's, from ``aggregate``

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        """The mean of the agents' models, published for the global curve (FedAMP itself needs none), from the
        same pass over them as their Gram matrix (``plan_starts``' attention): distances are taken between
        models centered on the global one, cosines between the models themselves."""
        center = global_vector if self.options.attention == "distance" else None
        mean, gram = mean_and_gram(global_vector, contributions, center)
        self.gram = ([c.agent for c in contributions], gram)
        return RoundResult(mean)

    def plan_starts(self, models: KeptModels | None) -> StartPlan:
        assert models is not None  # keeps_models
        agents, gram = self.gram
        if agents != models.agents:
            raise RuntimeError("FedAMP plans the starts of the agents it aggregated, in their order")
        self.gram = ([], np.zeros((0, 0)))
        views = [Contribution(a, models.vector(models.kept[a]), 1.0, 1.0, 0.0) for a in models.agents]
        xi = attention_weights(gram, self.options)
        starts, own = {}, self.options.start == "own"
        writer = functools.partial(models.writer, fingerprinted=not own)  # own: uᵢ is only ever a bundle's row
        clouds = keep_mixed(writer, [f"cloud-{agent}" for agent in models.agents], views, xi)
        for agent, cloud_model in zip(models.agents, clouds, strict=True):
            if own:  # wᵢ, with uᵢ beside it for the proximal pull
                starts[agent] = replace(models.own(agent), peers=models.peers((cloud_model,)))
            else:
                starts[agent] = Assignment("inbox", cloud_model)
        detail = {"self_weight": {a: round(float(xi[i, i]), 6) for i, a in enumerate(models.agents)}}
        return StartPlan(publish=True, starts=starts, detail=detail)
