"""How far apart the agents' models end a FedAMP (or Local) run, and how much of each attention's weight on the
others lands on agents that share a label with it (docs/results/personalization.md, "FedAMP in the paper's form,
tuned"). Reads a finished ``skyfed sim --in-process`` run: the models the server kept after the last round
(``federation/server/state/checkpoint/agents/r<last>/``: each agent's own model, or its cloud model where the
server keeps only that) and each agent's training labels (``federation/agent-*/data.npz``).
Run: PYTHONPATH=. python experiments/fedamp_spread.py RUN_FOLDER
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from models.serialization import load_file

SIGMAS = {"distance": (0.1, 1.0, 40.0), "cosine": (10.0, 100.0)}


def kept_vectors(run: Path) -> tuple[list[str], np.ndarray, str]:
    folder = run / "federation"
    agents = sorted(p.parent.name for p in folder.glob("agent-*/data.npz"))
    last = max((folder / "server/state/checkpoint/agents").glob("r*"), key=lambda p: int(p.name[1:]))
    rows = []
    for agent in agents:
        path = last / f"{agent}.safetensors"
        arrays, _ = load_file(path if path.exists() else last / f"+cloud-{agent}.safetensors")
        rows.append(np.concatenate([arrays[k].ravel() for k in sorted(arrays) if arrays[k].dtype.kind == "f"]))
    return agents, np.array(rows, np.float64), last.name


def share_on_neighbours(weights: np.ndarray, sharing: np.ndarray) -> float:
    """Mean over agents of the share of its weight on the others that falls on agents sharing a label."""
    return float(((weights * sharing).sum(1) / weights.sum(1)).mean())


def main(run: Path) -> None:
    agents, vectors, last = kept_vectors(run)
    labels = [set(np.unique(np.load(run / "federation" / a / "data.npz")["y"]).tolist()) for a in agents]
    n, self_ = len(agents), np.eye(len(agents), dtype=bool)
    sharing = np.array([[bool(a & b) for b in labels] for a in labels]) & ~self_
    d2 = ((vectors[:, None, :] - vectors[None, :, :]) ** 2).sum(-1)
    print(f"{run.name} ({last}): mean squared distance {d2[sharing].mean():.2f} between agents sharing a label, "
          f"{d2[~sharing & ~self_].mean():.2f} between the others; uniform weights would put "
          f"{(sharing.sum(1) / (n - 1)).mean():.3f} on label-sharing agents")  # fmt: skip
    off = np.where(self_, np.inf, d2)
    for sigma in SIGMAS["distance"]:
        raw = np.exp(-off / sigma) / sigma  # αₖ = 1
        relative = np.exp(-(off - off.min(axis=1, keepdims=True)) / sigma)  # the same proportions, no underflow
        print(f"  distance σ={sigma:g}: share {share_on_neighbours(relative, sharing):.3f}, the others' weights "
              f"sum to {raw.sum(1).mean():.3g} on average (before the self-weight floor)")  # fmt: skip
    norms = np.linalg.norm(vectors, axis=1)
    cos = vectors @ vectors.T / np.outer(norms, norms)
    for sigma in SIGMAS["cosine"]:
        weights = np.where(self_, 0.0, np.exp(sigma * (cos - 1)))
        print(f"  cosine σ={sigma:g}: share {share_on_neighbours(weights, sharing):.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
