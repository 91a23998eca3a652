"""The SuperLink's ServerApp: Flower's FedAvg over every SuperNode from SkyFed's initial model, with no federated
evaluation (SkyFed's rounds have none either); after each round the global model is scored on the server's
evaluation set with SkyFed's ``evaluate`` and a line ``{"round", "at", "accuracy", "loss"}`` is appended to ``out``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from models.datasets import load_npz
from models.training import evaluate
from models.weights import load_arrays
from models.zoo import build_model, initial_model, pick_device

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = context.run_config
    agents, name = int(run["agents"]), str(run["model"])
    model = build_model(name, num_classes=10)
    load_arrays(model, initial_model(name, 10, int(run["seed"])))
    test, out, device = load_npz(str(run["test-data"])), Path(str(run["out"])), pick_device()

    def scored(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        metrics = evaluate(model, test, device)
        with out.open("a") as lines:
            lines.write(json.dumps({"round": server_round, "at": time.time(), **metrics}) + "\n")
        return MetricRecord(metrics)

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=agents, min_available_nodes=agents)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=int(run["rounds"]),
                   train_config=ConfigRecord({}), evaluate_fn=scored)  # fmt: skip
