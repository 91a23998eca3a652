"""A SuperNode's training: SkyFed's ``train_sgd`` on the agent's own ``data.npz``, seeded as that agent's trainer
seeds the round (``participant.classifier.round_seed``), on one thread as SkyFed's agents train."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from models.datasets import load_npz
from models.training import seed_training, train_sgd
from models.zoo import build_model, pick_device
from participant.classifier import round_seed

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    config, run = msg.content["config"], context.run_config
    agent = str(context.node_config["agent"])
    model = build_model(str(run["model"]), num_classes=10)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    seed = round_seed(int(run["seed"]), agent, int(config["server-round"]))
    seed_training(seed)
    outcome = train_sgd(model, load_npz(str(context.node_config["data"])), epochs=int(run["epochs"]),
                        batch_size=int(run["batch-size"]), lr=float(run["lr"]), momentum=float(run["momentum"]),
                        seed=seed, device=pick_device())  # fmt: skip
    metrics = MetricRecord({"train_loss": outcome.loss, "num-examples": outcome.samples})
    return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)
