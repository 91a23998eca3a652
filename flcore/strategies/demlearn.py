"""DemLearn: self-organizing democratized learning (seed 000; Nguyen et al., "Self-organizing Democratized
Learning: Towards Large-scale Distributed Learning Systems", arXiv:2007.03278; the authors' code is
``nhatminh/Dem-AI``).

Every round the server clusters the agents' models (agglomerative, Euclidean or cosine distance) into a
binary hierarchy cut to ``levels`` group levels under the root, every ``tau`` rounds (and whenever the
agents whose update counted are not the tree's). Group models are built bottom-up as member-weighted
means of the level below — at level k that is the plain mean of the agents under the group — then mixed
top-down, w⁽ᵏ⁾ ← α·w⁽ᵏ⁺¹⁾ + (1 − α)·w⁽ᵏ⁾ (the thesis's eq. 10). Each agent starts the next round from its
level-1 group model, sealed to it alone, and trains with the proximal term (μ/2)·‖w − w⁽¹⁾‖² (the PLP,
eq. 8; FedProx's ``prox_mu`` toward the start model). The root, the mean of every agent's model, is
published as the global model.

Unrolled, a level-1 group model is Σₖ cₖ·mₖ over its ancestors' member means mₖ (c = (1 − α)·αᵏ⁻¹ for the
group levels, α^levels for the root), so ``group_mixing`` gives it as one weight per agent and the models
are read in column blocks from the server's model store (``mixing.mixed_models``: 256 MB of results at a time).

Choices where the thesis leaves room (docs/strategies.md): distances between whole models are average
linkage (UPGMA) on the pairwise distance matrix (the thesis calls its rule "average linkage" but defines
a centroid distance; the authors' code uses SciPy's hierarchy); cosine distance is 1 − cos; a branch
that ends above the cut goes on as a single-member chain; the optional amplification (×1.15 in the first
5 rounds in the thesis, which scales "the update") scales the change of each level-1 group model — what
agents start from — from the round's global model, w ← g + a·(w − g), except the BatchNorm statistics
(extrapolated, a running variance could go negative), so it never scales weights themselves, and the
published root stays the plain mean; members are counted as agents (not samples), as in eq. 9.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from flcore.agent_models import Assignment
from flcore.strategies.base import (
    KEPT_MODELS_NOT_PEERS,
    Contribution,
    KeptModels,
    NamedArrays,
    RoundResult,
    StartPlan,
    Strategy,
    TrainPlan,
    asking,
    mean_of_models,
)
from flcore.strategies.krum import gram_matrix, mean_and_gram
from flcore.strategies.mixing import mixed_models
from models.weights import RUNNING_STATISTICS, ranges_of
from protocol.messages import TrainSettings, headline

DISTANCES = ("euclidean", "cosine")


@dataclass(frozen=True)
class DemLearnOptions:
    levels: int = 3  # group levels under the root (the authors' K_Levels; the paper's K counts the root too)
    tau: int = 1  # re-cluster every tau rounds
    alpha: float = 0.6  # weight of the parent in the top-down pass (the authors' MNIST setting)
    mu: float = 0.002  # proximal weight toward the level-1 group model (the authors' PARAMS_mu)
    distance: str = "euclidean"
    amplify: float = 1.0  # the thesis's 1.15 for the first amplify_rounds rounds; 1.0 = off
    amplify_rounds: int = 5

    def __post_init__(self) -> None:
        if self.levels < 1:
            raise ValueError(f"strategy.levels must be >= 1 (group levels under the root), got {self.levels}")
        if self.tau < 1:
            raise ValueError(f"strategy.tau must be >= 1 (rounds between re-clusterings), got {self.tau}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"strategy.alpha must be in [0, 1] (the parent's weight top-down), got {self.alpha}")
        if self.mu < 0:
            raise ValueError(f"strategy.mu must be >= 0 (0: no proximal term), got {self.mu}")
        if self.distance not in DISTANCES:
            raise ValueError(f"strategy.distance {self.distance!r} must be one of {', '.join(DISTANCES)}")
        if not 0 < self.amplify <= 2:
            raise ValueError(f"strategy.amplify must be in (0, 2] (1: off; the thesis uses 1.15), got {self.amplify}")
        if self.amplify_rounds < 0:
            raise ValueError(f"strategy.amplify_rounds must be >= 0, got {self.amplify_rounds}")


def distance_matrix(gram: np.ndarray, distance: str) -> np.ndarray:
    """Pairwise distances between models from their inner products (``gram``)."""
    diag = np.diag(gram)
    if distance == "cosine":
        norms = np.sqrt(np.maximum(diag, 0.0))
        outer = np.outer(norms, norms)
        cosine = np.divide(gram, outer, out=np.zeros_like(gram), where=outer > 0)
        out = 1.0 - cosine
    else:
        out = np.sqrt(np.maximum(diag[:, None] + diag[None, :] - 2 * gram, 0.0))
    np.fill_diagonal(out, 0.0)
    return (out + out.T) / 2  # exactly symmetric, as squareform requires


def cluster_paths(distances: np.ndarray, levels: int) -> list[tuple[int, ...]]:
    """Each model's path of ``levels`` branch choices from the root of the average-linkage dendrogram
    (0 once its branch has ended: a single-member chain)."""
    n = len(distances)
    if n == 1:
        return [(0,) * levels]
    from scipy.cluster.hierarchy import linkage, to_tree  # SciPy on first use (flcore.blas says why)
    from scipy.spatial.distance import squareform

    root = to_tree(linkage(squareform(distances, checks=False), method="average"))
    paths: list[tuple[int, ...]] = [()] * n
    stack = [(root, ())]
    while stack:
        node, path = stack.pop()
        if node.is_leaf() or len(path) == levels:
            for leaf in node.pre_order():
                paths[leaf] = path + (0,) * (levels - len(path))
            continue
        stack += [(node.get_left(), (*path, 0)), (node.get_right(), (*path, 1))]
    return paths


def group_mixing(
    paths: list[tuple[int, ...]], alpha: float, level: int = 1
) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """The groups of ``level`` (their paths from the root) and, per group, the weight of each agent's model
    in the group's model after the bottom-up means and the top-down α-mix: rows sum to 1."""
    depth = len(paths[0]) - level + 1  # a level-k group is named by the first depth choices of its members' paths
    groups = sorted({p[:depth] for p in paths})
    mixing = np.zeros((len(groups), len(paths)))
    for row, group in enumerate(groups):
        for up in range(depth + 1):  # 0: the group itself, 1: its parent, …, depth: the root
            prefix = group[: depth - up]
            coefficient = (1 - alpha) * alpha**up if up < depth else alpha**depth
            members = [j for j, p in enumerate(paths) if p[: len(prefix)] == prefix]
            mixing[row, members] += coefficient / len(members)
    return groups, mixing


class DemLearn(Strategy):
    name = "demlearn"
    Options = DemLearnOptions
    keeps_models = True
    models = "group"
    peers = KEPT_MODELS_NOT_PEERS
    why_not_private = "each agent receives its group model, built from the other agents' models, un-noised"
    tasks = frozenset({"classify"})
    why_not_tasks = "needs a proximal term toward each agent's group model, which the detector trainer does not have"

    def __init__(self, options: DemLearnOptions | None = None) -> None:
        super().__init__(options)
        self.tree: dict[str, list[int]] = {}  # agent → path, as last clustered (kept in the checkpoint)
        self._pending: dict[str, list[int]] | None = None  # a new clustering, until its round is committed
        self.gram: tuple[list[str], np.ndarray] = ([], np.zeros((0, 0)))  # from ``aggregate``'s pass, when it made one
        self.start_vector = np.zeros(0, np.float32)

    def configure_train(self, settings: TrainSettings, round_number: int, paces: dict[str, float]) -> TrainPlan:
        return TrainPlan(asking(settings, "proximal", mu=self.options.mu))

    def action(self, round_number: int) -> str:
        return "group"

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        """The root, published as the global model: the mean of every agent's model (eq. 9 up to the top). When
        the round re-clusters whatever its number (``tau`` = 1, the default, or agents other than the tree's), the
        mean comes from the same pass over the models as their Gram matrix (``plan_starts``' distances), one pass
        over 1.28 GB fewer at 100 agents × 3.2M values."""
        self.start_vector = global_vector
        agents = [c.agent for c in contributions]
        if self.options.tau > 1 and set(self.tree) == set(agents):
            return RoundResult(mean_of_models(global_vector, contributions, np.ones(len(contributions))))
        mean, gram = mean_and_gram(global_vector, contributions, self._center(global_vector))
        self.gram = (agents, gram)
        return RoundResult(mean)

    def _center(self, global_vector: np.ndarray) -> np.ndarray | None:
        """What the distances are taken from: the global model (euclidean); cosines are of the models themselves."""
        return global_vector if self.options.distance == "euclidean" else None

    def plan_starts(self, models: KeptModels | None) -> StartPlan:
        assert models is not None  # keeps_models
        agents = models.agents
        views = [Contribution(a, models.vector(models.kept[a]), 1.0, 1.0, 0.0) for a in agents]
        due = (models.round - 1) % self.options.tau == 0 or set(self.tree) != set(agents)
        (known, gram), self.gram = self.gram, ([], np.zeros((0, 0)))
        if due:
            if known != agents:  # aggregate's pass made none for them
                gram = gram_matrix(views, center=self._center(self.start_vector))
            paths = cluster_paths(distance_matrix(gram, self.options.distance), self.options.levels)
            tree = self._pending = {a: list(p) for a, p in zip(agents, paths, strict=True)}
        else:  # and no clustering of a rolled-back round is left pending to be installed at the next commit
            tree, self._pending = self.tree, None
        paths = [tuple(tree[a]) for a in agents]
        by_level = {k: group_mixing(paths, self.options.alpha, k) for k in range(1, self.options.levels + 1)}
        rows = [(k, group) for k, (groups, _) in by_level.items() for group in groups]
        mixing = np.vstack([weights for _, weights in by_level.values()])  # every group of every level
        a = self.options.amplify if models.round <= self.options.amplify_rounds else 1.0
        holdings, report = {}, []
        for row, vector in mixed_models(views, mixing):  # Σ weights = 1, so this amplifies each model's change
            level, group = rows[row]
            members = sorted(agent for agent, path in zip(agents, paths, strict=True) if path[: len(group)] == group)
            entry = {"level": level, "group": "".join(map(str, group)), "members": members}
            if level == 1:  # what the members start from: kept, sealed to each
                vector = vector if a == 1.0 else self._amplified(vector, a, models)
                holdings[group] = models.put(f"group-{entry['group']}", vector)
            if models.evaluate is not None and (score := headline(models.evaluate(vector))) is not None:
                entry["g_gen"] = round(float(score), 6)  # the group model on the server's evaluation set
            report.append(entry)
        starts = {agent: Assignment("inbox", holdings[tuple(tree[agent])]) for agent in agents}
        report.sort(key=lambda e: (-e["level"], e["group"]))
        return StartPlan(publish=True, starts=starts, detail={"groups": report, "reclustered": due})

    def _amplified(self, vector: np.ndarray, a: float, models: KeptModels) -> np.ndarray:
        """``g + a·(w − g)`` but for the BatchNorm statistics, which stay the group's mean: extrapolated, a
        running variance that fell below (1 − 1/a) of the global model's (13 % at ×1.15) would go negative."""
        out = a * vector + (1 - a) * self.start_vector
        for r in ranges_of(models.spec, RUNNING_STATISTICS):
            out[r.start : r.stop] = vector[r.start : r.stop]
        return out

    def on_commit(self, result: RoundResult) -> None:
        if self._pending is not None:
            self.tree, self._pending = self._pending, None

    def state(self) -> NamedArrays:
        return {"tree": np.frombuffer(json.dumps(self.tree).encode(), np.uint8).copy()}  # arrays only: JSON bytes

    def restore(self, state: NamedArrays) -> None:
        if "tree" in state:
            self.tree = json.loads(bytes(np.asarray(state["tree"], np.uint8)).decode())
