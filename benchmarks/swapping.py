"""SimFedSwap's server step for many agents of the digits CNN: similarity of every pair, then pairing.

The thesis (seed 004, §5-10) needed about 20 minutes per similarity-and-swap step for 540 agents on a
GPU. Target: similarity (each of ``METRICS``: OSAD, CCA, HSIC, linear CKA, RBF CKA, deconfounded CKA)
plus MSS pairing for 540 agents in ≤ 10 s on this 2-core machine; N = 100 and 540 are reported.
Baseline in the same run: reading every agent's weights once (stacking them), so the figure is also a
ratio to that floor.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.common import report
from flcore.pairing import pair_minimum_similarity
from flcore.similarity import METRICS, similarity_matrix, weight_layers
from models.weights import to_arrays
from models.zoo import build_model


def agent_models(count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``count`` variants of one digits CNN, as if each agent had trained it a little differently."""
    torch.manual_seed(seed)
    base = to_arrays(build_model("digits_cnn", num_classes=10))
    rng = np.random.default_rng(seed)
    floats = {k: v for k, v in base.items() if v.dtype.kind == "f"}

    def variant() -> dict[str, np.ndarray]:
        return {k: v + 0.05 * rng.standard_normal(v.shape).astype(v.dtype) for k, v in floats.items()}

    return [variant() for _ in range(count)]


def timed(fn) -> tuple[float, object]:  # noqa: ANN001
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main() -> list[dict]:
    rows = []
    for count in (100, 540):
        models = agent_models(count)
        stack_s, layers = timed(lambda m=models: weight_layers(m))
        figures: dict[str, float | int] = {"agents": count, "stack_weights_s": round(stack_s, 3)}
        worst = 0.0
        for metric in METRICS:
            seconds, similarity = timed(lambda m=metric, layers=layers: similarity_matrix(layers, m))
            pair_s, _ = timed(lambda s=similarity: pair_minimum_similarity(s, 1.0))
            figures[f"{metric}_similarity_s"] = round(seconds, 3)
            figures[f"{metric}_mss_s"] = round(pair_s, 3)
            worst = max(worst, seconds + pair_s)
        figures["slowest_step_s"] = round(worst, 2)
        rows.append(
            report(
                f"simfedswap_step_{count}_agents",
                target="similarity + MSS pairing <= 10 s for 540 agents",
                ok=worst <= 10.0 if count == 540 else True,
                **figures,
            )
        )
    return rows


if __name__ == "__main__":
    main()
