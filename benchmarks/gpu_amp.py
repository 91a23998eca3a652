"""Mixed precision on a GPU agent (participant/amp.py): skipped optimizer steps, loss and time of short YOLO rounds.

``python -m benchmarks.gpu_amp --out DIR [--rounds 4] [--modes amp-kept,amp-reset,fp32,cpu]`` trains one
agent's rounds of YOLO11n on the synthetic aerial set (192 images at 160 px, batch 16: 12 optimizer steps
a round), each round from the last one's weights, as an agent whose own update is the next global model:

- ``amp-kept``: ``[training] amp = true`` on the GPU (the loss scale carried across rounds, ``participant.amp``)
- ``amp-reset``: the same with the kept scale removed before every round (a new GradScaler at 65,536 each
  round, as every round on main)
- ``fp32``: ``amp = false`` (the default) on the GPU
- ``cpu``: the CPU, for reference

One JSON line per round: optimizer steps, steps skipped (the scale fell), the scale before and after, the
training loss, seconds, and network lookups attempted (all refused: a drone has no network).
"""

from __future__ import annotations

import argparse
import inspect
import json
import socket
import time
from pathlib import Path

MODES = ("amp-kept", "amp-reset", "fp32", "cpu")
TRAIN_IMAGES, VAL_IMAGES, BATCH, IMAGE_SIZE = 192, 32, 16, 160
NETWORK: list[str] = []
STEPS: list[tuple[float, float]] = []  # (scale before, scale after) of every optimizer step


def refuse_network() -> None:
    """Record and refuse every DNS lookup and connect (a hanging link would stall the round)."""

    def refuse(*args: object, **kwargs: object) -> None:
        NETWORK.append(repr(args)[:120])
        raise OSError("no network on a drone")

    socket.getaddrinfo = refuse  # type: ignore[assignment]
    socket.socket.connect = lambda self, address: refuse(address)  # type: ignore[method-assign]


def watch_steps() -> None:
    """Record the loss scale around each of Ultralytics' optimizer steps (a skipped step lowers it)."""
    from ultralytics.engine.trainer import BaseTrainer

    step = BaseTrainer.optimizer_step

    def watched(trainer: BaseTrainer) -> None:
        before = trainer.scaler.get_scale() if trainer.scaler.is_enabled() else 0.0
        step(trainer)
        STEPS.append((before, trainer.scaler.get_scale() if trainer.scaler.is_enabled() else 0.0))

    BaseTrainer.optimizer_step = watched


def run_mode(mode: str, data: Path, out: Path, rounds: int) -> list[dict]:
    import torch

    from models.synthetic_detection import NAMES
    from models.weights import to_arrays
    from models.zoo import build_model
    from participant.detector import DetectorTrainer
    from protocol.messages import RoundTask, TrainSettings

    device = torch.device("cpu" if mode == "cpu" else "cuda")
    work = out / mode
    # main's trainer had no amp switch (it forced Ultralytics' AMP on CUDA): run on main's code, its "before" row
    amp = {"amp": mode.startswith("amp")} if "amp" in inspect.signature(DetectorTrainer).parameters else {}
    trainer = DetectorTrainer(data, device=device, agent_id="agent-01", work_dir=work, **amp)
    torch.manual_seed(0)
    arrays = to_arrays(build_model("yolo11n", num_classes=len(NAMES)))
    settings = TrainSettings(epochs=1, batch_size=BATCH, lr=0.01, momentum=0.9, image_size=IMAGE_SIZE)
    rows = []
    for number in range(1, rounds + 1):
        task = RoundTask(federation="bench", round=number, attempt=1, strategy="fedavg", model="yolo11n",
                         num_classes=len(NAMES), model_version=number, model_sha256="00" * 32, model_chunks=1,
                         group_key_id="", selected=["agent-01"], pending=["agent-01"], deadline=time.time() + 600,
                         issued_at=time.time(), train=settings, run_id="bench", classes=list(NAMES))  # fmt: skip
        if mode == "amp-reset":
            (work / "grad_scaler.json").unlink(missing_ok=True)
        STEPS.clear()
        lookups = len(NETWORK)
        started = time.perf_counter()
        result = trainer.train(arrays, task)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        arrays = result.arrays
        skipped = sum(after < before for before, after in STEPS)
        rows.append({"mode": mode, "round": number, "steps": len(STEPS), "skipped": skipped,
                     "scale_start": STEPS[0][0] if STEPS else 0.0, "scale_end": STEPS[-1][1] if STEPS else 0.0,
                     "loss": round(result.loss, 4), "map50": result.local_eval.get("map50"),
                     "seconds": round(seconds, 2), "network_lookups": len(NETWORK) - lookups})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_amp", description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    refuse_network()
    from models.synthetic_detection import write_dataset
    from models.yolo import ultralytics_offline

    ultralytics_offline(args.out / "ultralytics")
    data = write_dataset(args.out / "data", train=TRAIN_IMAGES, val=VAL_IMAGES, seed=1, size=IMAGE_SIZE)
    watch_steps()
    for mode in args.modes.split(","):
        run_mode(mode, data, args.out, args.rounds)


if __name__ == "__main__":
    main()
