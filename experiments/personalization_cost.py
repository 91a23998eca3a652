"""Server time of DemLearn's clustering, FedAMP's attention and FedAMN's k-means at the end of a round
(targets: 50 agents under 10 ms per round, 540 agents of the digits CNN under 2 s).

The decision alone (Gram matrix and clustering or attention weights), and ``Strategy.aggregate`` plus
``plan_starts`` (where the per-agent models or bundles are built: ``aggregate_s`` in metrics.jsonl) as
``benchmarks.kept_models`` does, on the real model sizes: every agent's model written to the server's model
store on disk (four kinds of agents plus noise), median of 5 end-of-round passes after a warm-up.
Run: PYTHONPATH=. python experiments/personalization_cost.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import median_seconds, report
from flcore.agent_models import ModelBank
from flcore.strategies import build_strategy
from flcore.strategies.base import Contribution, KeptModels
from flcore.strategies.demlearn import DemLearnOptions, cluster_paths, distance_matrix
from flcore.strategies.fedamn import FedAMNOptions, clusters_within, principal_coordinates
from flcore.strategies.fedamp import FedAMPOptions, attention_weights
from flcore.strategies.krum import gram_matrix
from models.weights import TensorSpec
from models.zoo import build_model

CASES = (("mnist1d_cnn", 20), ("mnist1d_cnn", 50), ("digits_cnn", 540))


def decision(name: str, views: list[Contribution]) -> object:
    """What the strategy decides from the models: DemLearn's tree, FedAMP's attention weights, FedAMN's clusters."""
    gram = gram_matrix(views)
    if name == "demlearn":
        return cluster_paths(distance_matrix(gram, DemLearnOptions().distance), DemLearnOptions().levels)
    if name == "fedamn":
        centered = gram_matrix(views, center=np.mean([v.delta for v in views], axis=0))
        return clusters_within(principal_coordinates(centered), FedAMNOptions().max_peers, np.random.default_rng(1))
    return attention_weights(gram, FedAMPOptions())


def end_of_round_seconds(name: str, agents: int, params: int) -> tuple[float, float]:
    """Median seconds of ``name``'s aggregate + plan_starts (the per-agent models built and written to the
    store included), and of its decision alone (Gram matrix and clustering or attention weights)."""
    spec = (TensorSpec("w", "float32", (params,)),)
    rng = np.random.default_rng(0)
    kinds = [rng.standard_normal(params, dtype=np.float32) for _ in range(4)]
    with tempfile.TemporaryDirectory(prefix="skyfed-cost-") as folder:
        bank = ModelBank(Path(folder))
        kept = {}
        for i in range(agents):
            vector = kinds[i % 4] + 0.1 * rng.standard_normal(params, dtype=np.float32)
            kept[f"agent-{i:03d}"] = bank.writer(1, f"agent-{i:03d}", spec, {}).keep(vector)
        views = [Contribution(a, bank.vector(h), 1.0, 1.0, 0.0, model=bank.vector(h)) for a, h in kept.items()]
        def one_round() -> None:
            strategy = build_strategy({"name": name, **({"after": 1} if name == "fedamn" else {})})
            models = KeptModels(round=1, action=strategy.action(1), agents=list(kept), kept=kept, exact=set(kept),
                                current={}, spec=spec, vector=bank.vector,
                                writer=bank.new_models(1, spec, {}),
                                peers=lambda holdings: bank.peers(holdings, spec),
                                rng=lambda: np.random.default_rng(1))  # fmt: skip
            strategy.aggregate(np.zeros(params, np.float32), views)
            strategy.plan_starts(models)

        return median_seconds(one_round, 5), median_seconds(lambda: decision(name, views), 5)


def main() -> None:
    for model, agents in CASES:
        params = sum(p.numel() for p in build_model(model).parameters())
        for name in ("demlearn", "fedamp", "fedamn"):
            started = time.perf_counter()
            seconds, decide = end_of_round_seconds(name, agents, params)
            limit = 0.010 if agents <= 50 else 2.0
            report(f"{name}_{model}_{agents}", target=f"clustering/attention < {limit * 1e3:g} ms", ok=decide < limit,
                   agents=agents, params=params, decision_ms=round(decide * 1e3, 2),
                   end_of_round_ms=round(seconds * 1e3, 2), wall_s=round(time.perf_counter() - started, 1))  # fmt: skip


if __name__ == "__main__":
    main()
