"""FedAMN: personalized FL with an attention-enhanced meta-learning network (seed 003: Gao et al., 计算机研究与发展
61(1), 2024), the server's half.

The server collects every agent's model, publishes their sample-weighted mean as the global model w_g
(FedAvg: the seed's "soft start", its Algorithm 1 step ⑥), clusters the models with k-means (step ⑤) and
sends each agent the other models of its cluster W_k, sealed to it alone (step ⑦). The agent's half is the
attention meta-network (``participant.meta_attention``): with its own model as query it attends over them, then
blends in w_g, trains that network on its own data and starts its base network's training from the result.

Progressive training (seed §3.1): before round ``after`` (the seed's p) the federation is plain FedAvg:
every agent starts from w_g. From round p on, each agent starts from its own kept model and gets its
cluster's models; the task's ``meta_epochs``/``meta_lr`` are the meta-network's training (seed §2.4,
"alternating training": meta-network first, then the base network from its output).

Choices where the seed is silent (its equations, k and p are lost, seed note §2.5): no agent gets more
than ``max_peers`` models of others, so clusters hold at most ``max_peers`` + 1; k-means runs with the
smallest k that allows it, ⌈n / (``max_peers`` + 1)⌉ (the seed: "k = the smallest value within the
traffic limit"), and a cluster still too large is split the same way (into equal shares if its models
are identical: sybils cannot make one cluster no k fits, leaving everyone else alone); k-means sees the
models' exact Euclidean geometry (classical scaling of their Gram matrix, centered on the round's start
model, so the n × d models are read once). Layer 1's keys are the *other* agents' models: the seed's layer
"scores the target client's similarity to the others", and its Fig. 5 has two clients give *each other*
the top score; with its own model among them, an attention trained on the agent's own data picks that
model, which fits that data best (a first version did: weight 0.8-1.0 on one row by round 12, and the
global weight 0). Each bundle is built for its recipient from a secret (``agent_models.ModelBank.peers``): rows
in a random order, values dithered, so neither a row's place nor its fingerprint names its owner. An agent
alone in its cluster (an outlier: an unusual data mix, or a rogue) gets no other agent's model and trains
on from its own. ``prox_mu`` is the seed's unspecified regularization λ, toward the meta-network's output
(0 by default).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace

import numpy as np

from flcore.strategies.base import (
    KEPT_MODELS_NOT_PEERS,
    Contribution,
    KeptModels,
    RoundResult,
    StartPlan,
    Strategy,
    TrainPlan,
    asking,
    model_differences,
)
from flcore.strategies.fedavg import FedAvg
from flcore.strategies.krum import gram_matrix
from models.weights import TensorSpec
from protocol.messages import TrainSettings

EMBEDDING_DIMS = 32  # k-means runs on the models' leading principal coordinates: the clusters need no more


@dataclass(frozen=True)
class FedAMNOptions:
    after: int = 10  # p: the first round whose agents start from their own model and attend over their cluster's
    max_peers: int = 10  # the most models of others an agent downloads a round (clusters of max_peers + 1 at most)
    meta_epochs: int = 1  # the meta-network's passes over the agent's data each round
    meta_lr: float = 0.01  # its Adam learning rate
    prox_mu: float = 0.0  # λ: the base network's proximal weight toward the meta-network's output

    def __post_init__(self) -> None:
        if self.after < 1:
            raise ValueError(f"strategy.after must be >= 1 (the first round with the meta-network), got {self.after}")
        if self.max_peers < 1:
            raise ValueError(f"strategy.max_peers must be >= 1 (models an agent downloads a round), "
                             f"got {self.max_peers}")  # fmt: skip
        if self.meta_epochs < 0:
            raise ValueError(f"strategy.meta_epochs must be >= 0 (0: the meta-network is not trained), "
                             f"got {self.meta_epochs}")  # fmt: skip
        if not self.meta_lr > 0:
            raise ValueError(f"strategy.meta_lr must be > 0, got {self.meta_lr}")
        if self.prox_mu < 0:
            raise ValueError(f"strategy.prox_mu must be >= 0 (0: no proximal term), got {self.prox_mu}")


def principal_coordinates(gram: np.ndarray, dims: int = EMBEDDING_DIMS) -> np.ndarray:
    """Points whose pairwise distances are the models' (from their Gram matrix), in at most ``dims`` dimensions."""
    values, vectors = np.linalg.eigh(gram)
    top = np.argsort(values)[::-1][:dims]
    return vectors[:, top] * np.sqrt(np.maximum(values[top], 0.0))


def clusters_within(points: np.ndarray, max_size: int, rng: np.random.Generator) -> np.ndarray:
    """A cluster label per point, no cluster over ``max_size``: k-means with k = ⌈n / max_size⌉, and a cluster
    still too large split the same way (into equal shares where k-means cannot tell its points apart:
    identical models, say, which sybil agents could send to leave everyone else alone)."""
    n = len(points)
    k = math.ceil(n / max_size)
    if k == 1:
        return np.zeros(n, int)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "one of the clusters is empty": the others are split further
        from scipy.cluster.vq import kmeans2  # SciPy on first use (flcore.blas says why)

        _, labels = kmeans2(points, k, minit="++", rng=rng)
    if len(np.unique(labels)) == 1:  # no two points differ in a way k-means sees
        labels = np.arange(n) % k
    out, next_label = np.empty(n, int), 0
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        too_large = len(members) > max_size
        parts = clusters_within(points[members], max_size, rng) if too_large else np.zeros(len(members), int)
        out[members] = parts + next_label
        next_label += parts.max() + 1
    return out


class FedAMN(Strategy):
    name = "fedamn"
    Options = FedAMNOptions
    keeps_models = True
    models = "agent"
    bounded_by_clip = True  # w_g: a weighted mean of model changes clipped within the round's clip bound
    peers = KEPT_MODELS_NOT_PEERS
    why_not_private = "each agent receives its cluster mates' models un-noised"
    tasks = frozenset({"classify"})
    why_not_tasks = ("needs the attention meta-network, which the detector trainer does not have (every agent would "
                     "decline from strategy.after on)")  # fmt: skip
    local_dp = ("the attention meta-network also trains on each agent's data, outside DP-SGD's accounting, so every "
                "agent declines from strategy.after on")  # fmt: skip

    def __init__(self, options: FedAMNOptions | None = None) -> None:
        super().__init__(options)
        self.start_vector = np.zeros(0, np.float32)
        self.mean = FedAvg()

    def begin(self, global_vector: np.ndarray, spec: tuple[TensorSpec, ...]) -> None:
        self.mean.begin(global_vector, spec)

    def configure_train(self, settings: TrainSettings, round_number: int, paces: dict[str, float]) -> TrainPlan:
        o = self.options
        train = asking(settings, "attention", epochs=o.meta_epochs, lr=o.meta_lr)
        return TrainPlan(asking(train, "proximal", mu=o.prox_mu) if o.prox_mu else train)

    def action(self, round_number: int) -> str:
        return "personal"

    def run_problem(self, rounds: int) -> str:
        after = self.options.after
        if 0 < rounds < after:
            return (f"fedamn runs {rounds} rounds, all before strategy.after = {after}: the attention meta-network "
                    f"never joins and the run is plain FedAvg; set strategy.after to {rounds} or less, or run {after} "
                    "rounds or more")  # fmt: skip
        return ""

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        """w_g: the mean of the agents' models weighted by their capped samples, each model's change from w_g
        clipped at the round's longest clipped step (the clip bound when any update was clipped, never above
        it), so w_g moves no further than any aggregate may, however far a personalized model has drifted over
        rounds of clipped steps (the plain mean let three identical sybils of ten carry it off). Before
        ``after``, when all start from w_g, this is FedAvg."""
        self.start_vector = global_vector
        bound = max(c.scale * c.norm for c in contributions)
        changes = [replace(d, scale=bound / d.norm if d.norm > bound else 1.0)
                   for d in model_differences(global_vector, contributions)]  # fmt: skip
        result = self.mean.aggregate(global_vector, changes)
        return RoundResult(result.global_vector, {"models_clipped": sum(c.scale < 1 for c in changes)})

    def plan_starts(self, models: KeptModels | None) -> StartPlan:
        assert models is not None  # keeps_models
        if models.round + 1 < self.options.after:
            return StartPlan()  # progressive training: FedAvg until the meta-network joins
        rng = models.rng()
        views = [Contribution(a, models.vector(models.kept[a]), 1.0, 1.0, 0.0) for a in models.agents]
        size = self.options.max_peers + 1
        labels = np.zeros(len(views), int)
        if len(views) > size:
            gram = gram_matrix(views, center=self.start_vector)
            labels = clusters_within(principal_coordinates(gram), size, rng)
        starts, clusters = {}, []
        for label in np.unique(labels):
            members = [models.agents[i] for i in np.flatnonzero(labels == label)]
            for agent in members:
                mates = tuple(models.kept[a] for a in members if a != agent)
                starts[agent] = replace(models.own(agent), peers=models.peers(mates) if mates else None)
            clusters.append(sorted(members))
        return StartPlan(publish=True, starts=starts, detail={"clusters": sorted(clusters)})
