"""Cross-check for docs/results/swapping.md: the FedSwap schedule in plain PyTorch, no broker, no server.

``python experiments/swap_without_skyfed.py MODE LR`` with MODE ``local`` or ``swap``: 10 agents on the
bundled digits, 2 labels each (``shards:2``), 1 epoch per round, an average every 2 rounds and in
between either local training only or a random swap. Prints round, action and the test accuracy of the
sample-weighted mean of the agents' models. Used to tell a bug in SkyFed's swapping from the method's
own behaviour at a given learning rate.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from models import partition
from models.datasets import load_digits
from models.training import evaluate, train_sgd
from models.weights import load_arrays, to_arrays
from models.zoo import build_model

AGENTS, ROUNDS = 10, 12


def trained(arrays: dict, data, lr: float, seed: int) -> dict:  # noqa: ANN001
    model = build_model("digits_cnn", num_classes=10)
    load_arrays(model, arrays)
    train_sgd(model, data, epochs=1, batch_size=32, lr=lr, momentum=0.9, seed=seed, device=torch.device("cpu"))
    return to_arrays(model)


def mean(models: list[dict], weights: list[int]) -> dict:
    out = {}
    for name, value in models[0].items():
        if np.issubdtype(value.dtype, np.floating):
            total = sum(w * m[name].astype(np.float64) for m, w in zip(models, weights, strict=True))
            out[name] = (total / sum(weights)).astype(value.dtype)
        else:
            out[name] = value
    return out


def main(mode: str, lr: float) -> None:
    train, test = load_digits(0.2, 0)
    datas = [train.subset(p) for p in partition.parse("shards:2")(train.y, AGENTS, 0)]
    weights = [len(d) for d in datas]
    torch.manual_seed(0)
    models = [to_arrays(build_model("digits_cnn", num_classes=10))] * AGENTS
    rng = np.random.default_rng(0)
    for t in range(1, ROUNDS + 1):
        models = [trained(models[k], datas[k], lr, 100 * t + k) for k in range(AGENTS)]
        action = "average" if t % 2 == 0 else mode
        if action == "average":
            models = [mean(models, weights)] * AGENTS
        elif action == "swap":
            order, swapped = rng.permutation(AGENTS), list(models)
            for a, b in zip(order[0::2], order[1::2], strict=True):
                swapped[a], swapped[b] = models[b], models[a]
            models = swapped
        evaluated = build_model("digits_cnn", num_classes=10)
        load_arrays(evaluated, mean(models, weights))
        print(t, action, round(evaluate(evaluated, test, torch.device("cpu"))["accuracy"], 3), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
