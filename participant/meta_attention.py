"""FedAMN's attention meta-network on the agent: the model an agent starts from, mixed by attention (seed 003).

The seed (Gao et al., 计算机研究与发展 61(1), 2024; seed 003, notes §2.2 and §2.4) gives the structure, two
layers of scaled dot-product attention with the agent's own model as query — layer 1 over the other models
of its cluster (``flcore.strategies.fedamn`` says why not its own), layer 2 over {layer-1
output, global model w_g} — and the "AMN step": the output w_att goes into the base network as its
parameters and the gradient of the local loss trains only the meta-parameters Θ. Its equations, what Θ
holds and how d-dimensional models are handled are missing; these are SkyFed's choices:

* Attention is per layer group: float tensors grouped by module (``name.rsplit(".", 1)[0]``), so a conv's
  weight and bias, or a BatchNorm's weight, bias and running statistics, share one attention.
* Features: a model's group vector minus w_g's, compressed to m = 32 values by a fixed count-sketch
  (``np.random.default_rng(zlib.crc32(group))`` draws ``bucket = rng.integers(0, m, d)`` then
  ``sign = 1 - 2 * rng.integers(0, 2, d)``: the same on every agent and round; a group of d ≤ m values is
  used as is, zero-padded), then scaled to unit length (a zero vector stays zero). Sketches are linear, so
  each row is sketched once and the sketch of a mix is the mix of the sketches.
* Layer 1: q = A_q·f_own, k_j = A_k·f_j, α = softmax(q·k_j/√h) (h = m), u = Σ_j α_j·w_j over full vectors.
* Layer 2: g_u = unit(Σ_j α_j·S_j) (S_j the unscaled sketches); u scores (B_q·f_own)·(B_k·g_u)/√h, w_g
  scores a learnt bias b (w_g's centred feature is zero); β = softmax; w_att = β_u·u + β_g·w_g.
* Θ per group: A_q, A_k, B_q, B_k (h×m, initialised to h^¼·I so that first scores are cosines in [−1, 1]
  and attention near uniform, as the seed's Fig. 5 shows at round 2) and b (0). Θ does not depend on the
  number of peers, which may change between rounds; it is kept in ``state_path`` (safetensors), Adam's
  moments are not. A missing file, or one of another model or not finite, starts from the initial Θ.
* Meta-training: Adam on Θ over ``epochs`` shuffled passes of the local training data, cross-entropy of the
  base network (train mode) run by ``torch.func.functional_call`` with w_att as its parameters and the
  mixed float buffers (detached) as its buffers; the base network's own weights are untouched.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from models.batches import Batches
from models.datasets import Dataset
from models.serialization import SerializationError, load_file, save_file
from models.training import on_device
from models.weights import NamedArrays, is_float

log = logging.getLogger("skyfed.agent")

SKETCH_SIZE = 32  # m, and the attention width h
THETA_SHAPES = {
    "A_q": (SKETCH_SIZE, SKETCH_SIZE),
    "A_k": (SKETCH_SIZE, SKETCH_SIZE),
    "B_q": (SKETCH_SIZE, SKETCH_SIZE),
    "B_k": (SKETCH_SIZE, SKETCH_SIZE),
    "b": (1,),
}


@dataclass(frozen=True)
class AttentionReport:
    peer_weights: list[float]  # layer-1 attention per peer row, averaged over layer groups
    global_weight: float  # layer-2 weight on w_g, averaged over layer groups
    loss: float  # mean meta-training loss of the last epoch; nan if no step ran
    steps: int


@dataclass(frozen=True)
class LayerGroup:
    """One module's float tensors, as the meta-network sees them (all on the compute device, float32)."""

    name: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # names and shapes, in state_dict order
    peers: torch.Tensor  # (n, d): the peer models' group vectors
    global_vector: torch.Tensor  # (d,)
    own_feature: torch.Tensor  # (m,) unit sketch of own − w_g
    peer_sketches: torch.Tensor  # (n, m) sketches of peer − w_g
    peer_features: torch.Tensor  # (n, m) the same at unit length


def layer_groups(names: list[str]) -> dict[str, list[str]]:
    """Tensor names grouped by module prefix, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.rsplit(".", 1)[0], []).append(name)
    return groups


def sketch_plan(group: str, size: int, m: int = SKETCH_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Bucket and sign of each of a group's ``size`` coordinates (identity for ``size`` ≤ ``m``)."""
    if size <= m:
        return np.arange(size), np.ones(size)
    rng = np.random.default_rng(zlib.crc32(group.encode()))
    bucket = rng.integers(0, m, size)
    return bucket, 1.0 - 2.0 * rng.integers(0, 2, size)


def _sketch(vector: np.ndarray, plan: tuple[np.ndarray, np.ndarray], m: int = SKETCH_SIZE) -> np.ndarray:
    bucket, sign = plan
    return np.bincount(bucket, weights=vector * sign, minlength=m)  # float64, deterministic on every device


def _unit(v: torch.Tensor) -> torch.Tensor:
    return nn.functional.normalize(v, dim=-1, eps=1e-30)


def build_groups(
    own: NamedArrays, peers: NamedArrays, global_model: NamedArrays, device: torch.device
) -> list[LayerGroup]:
    """Stack every group's peer rows once; ``ValueError`` naming the tensor when the inputs do not fit."""
    float_names = [name for name, a in own.items() if is_float(a)]
    rows = {peers[name].shape[0] for name in float_names if name in peers}
    if len(rows) != 1 or 0 in rows:
        raise ValueError(f"peers must give the same number (≥ 1) of rows for every tensor, got {sorted(rows)}")
    (n,) = rows
    groups = []
    for group, names in layer_groups(float_names).items():
        for name in names:
            if name not in peers or peers[name].shape != (n, *own[name].shape):
                raise ValueError(f"peers lack tensor {name!r} of shape {(n, *own[name].shape)}")
            if name not in global_model or global_model[name].shape != own[name].shape:
                raise ValueError(f"the global model lacks tensor {name!r} of shape {own[name].shape}")
        stacked = np.concatenate([peers[name].reshape(n, -1) for name in names], axis=1, dtype=np.float32)
        global_vector = np.concatenate([global_model[name].ravel() for name in names], dtype=np.float32)
        own_vector = np.concatenate([own[name].ravel() for name in names], dtype=np.float32)
        if not (np.isfinite(stacked).all() and np.isfinite(global_vector).all() and np.isfinite(own_vector).all()):
            raise ValueError(f"tensors of {group!r} hold NaN or Inf")
        plan = sketch_plan(group, global_vector.size)
        global_sketch = _sketch(global_vector, plan)
        sketches = np.stack([_sketch(row, plan) - global_sketch for row in stacked])
        on_device = dict(dtype=torch.float32, device=device)
        peer_sketches = torch.tensor(sketches, **on_device)
        groups.append(
            LayerGroup(
                name=group,
                tensors=tuple((name, own[name].shape) for name in names),
                peers=torch.from_numpy(stacked).to(device),
                global_vector=torch.from_numpy(global_vector).to(device),
                own_feature=_unit(torch.tensor(_sketch(own_vector, plan) - global_sketch, **on_device)),
                peer_sketches=peer_sketches,
                peer_features=_unit(peer_sketches),
            )
        )
    return groups


def initial_theta(groups: list[LayerGroup], device: torch.device) -> dict[str, torch.Tensor]:
    """Θ at its start: A's = h^¼·I (first scores are cosines), b = 0; keys ``<group>/<A_q|A_k|B_q|B_k|b>``."""
    theta = {}
    for group in groups:
        for key, shape in THETA_SHAPES.items():
            start = torch.zeros(shape) if key == "b" else SKETCH_SIZE**0.25 * torch.eye(SKETCH_SIZE)
            theta[f"{group.name}/{key}"] = start.to(device).requires_grad_()
    return theta


def _load_theta(path: Path, fresh: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The kept Θ when it fits this model, else ``fresh`` (one log line says why)."""
    if not path.exists():
        log.info("fedamn: no attention state at %s; starting from the initial attention", path)
        return fresh
    try:
        kept, _ = load_file(path)
    except (OSError, SerializationError) as exc:
        log.warning("fedamn: attention state %s unreadable (%s); starting from the initial attention", path, exc)
        return fresh
    if {k: (a.dtype, a.shape) for k, a in kept.items()} != {
        k: (np.dtype(np.float32), tuple(t.shape)) for k, t in fresh.items()
    }:
        log.warning("fedamn: attention state %s is of another model; starting from the initial attention", path)
        return fresh
    if not all(np.isfinite(a).all() for a in kept.values()):
        log.warning("fedamn: attention state %s is not finite; starting from the initial attention", path)
        return fresh
    return {k: torch.from_numpy(kept[k]).to(device).requires_grad_() for k in fresh}


def attend(group: LayerGroup, theta: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two attention layers over one group: (w_att group vector, α over peer rows, β = [β_u, β_g])."""
    t = {key: theta[f"{group.name}/{key}"] for key in THETA_SHAPES}
    scale = math.sqrt(SKETCH_SIZE)
    query = t["A_q"] @ group.own_feature
    alpha = _normal_or_zero(torch.softmax((group.peer_features @ t["A_k"].T) @ query / scale, dim=0))
    mixed = alpha @ group.peers
    mixed_feature = _unit(alpha @ group.peer_sketches)
    mixed_score = (t["B_q"] @ group.own_feature) @ (t["B_k"] @ mixed_feature) / scale
    beta = _normal_or_zero(torch.softmax(torch.cat([mixed_score.reshape(1), t["b"]]), dim=0))
    return beta[0] * mixed + beta[1] * group.global_vector, alpha, beta


def _normal_or_zero(weights: torch.Tensor) -> torch.Tensor:
    """``weights`` with each one below float32's smallest normal number (a softmax of logits about 87 apart) set to
    0: x86 cores multiply a subnormal on a slow path, which made α·peers 4.7x slower at 3.2M values (78 against 17 ms
    a step; docs/results/benchmarks.md), and its share is far below the rounding of the sum it joins."""
    return torch.where(weights < torch.finfo(weights.dtype).tiny, torch.zeros_like(weights), weights)


def _tensors(groups: list[LayerGroup], vectors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Group vectors cut back into named tensors."""
    out = {}
    for group, vector in zip(groups, vectors, strict=True):
        offset = 0
        for name, shape in group.tensors:
            size = math.prod(shape)
            out[name] = vector[offset : offset + size].reshape(shape)
            offset += size
    return out


def _meta_train(
    model: nn.Module,
    groups: list[LayerGroup],
    theta: dict[str, torch.Tensor],
    own: NamedArrays,
    data: Dataset,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    device: torch.device,
) -> tuple[float, int]:
    """Adam on Θ through the base network's loss; returns (mean loss of the last epoch, steps)."""
    parameters = {name for name, _ in model.named_parameters()}
    counts = {name: torch.from_numpy(a).to(device) for name, a in own.items() if not is_float(a)}
    on_device(model, device).train()
    optimizer = torch.optim.Adam(list(theta.values()), lr=lr)
    loader = Batches(data, batch_size=batch_size, shuffle=True, seed=seed)
    last_loss, steps = float("nan"), 0
    for _ in range(epochs):
        total, seen = 0.0, 0
        for x, y in loader:
            mixed = _tensors(groups, [attend(group, theta)[0] for group in groups])
            state = {name: t if name in parameters else t.detach().clone() for name, t in mixed.items()}
            state |= {name: t.clone() for name, t in counts.items()}  # BatchNorm counts them up in place
            logits = torch.func.functional_call(model, state, (x.to(device),))
            loss = nn.functional.cross_entropy(logits, y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            total += loss.item() * len(y)
            seen += len(y)
        last_loss = total / seen if seen else float("nan")
    return last_loss, steps


def attention_start(
    model: nn.Module,
    own: NamedArrays,
    peers: NamedArrays,
    global_model: NamedArrays,
    data: Dataset,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    device: torch.device,
    state_path: Path,
) -> tuple[NamedArrays, AttentionReport]:
    """Meta-train Θ on ``data`` for ``epochs``, keep it in ``state_path``, and return w_att — float tensors
    mixed by the attention, the others ``own``'s, each in ``own``'s dtype — with a report of the weights."""
    if set(own) != set(model.state_dict()):
        raise ValueError(f"own model's tensors do not match {type(model).__name__}'s state_dict")
    groups = build_groups(own, peers, global_model, device)
    theta = _load_theta(state_path, initial_theta(groups, device), device)
    loss, steps = _meta_train(
        model, groups, theta, own, data, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed, device=device
    )
    if not all(torch.isfinite(t).all() for t in theta.values()):
        log.warning("fedamn: attention diverged in meta-training (loss %s); starting from the initial attention", loss)
        theta = initial_theta(groups, device)
    save_file(state_path, {k: t.detach().cpu().numpy() for k, t in theta.items()})
    with torch.no_grad():
        results = [attend(group, theta) for group in groups]
    mixed = _tensors(groups, [vector for vector, _, _ in results])
    w_att = {name: mixed[name].cpu().numpy().astype(a.dtype) if name in mixed else a.copy() for name, a in own.items()}
    alphas = torch.stack([alpha for _, alpha, _ in results]).mean(dim=0)
    betas = torch.stack([beta for _, _, beta in results]).mean(dim=0)
    report = AttentionReport(peer_weights=alphas.tolist(), global_weight=float(betas[1]), loss=loss, steps=steps)
    return w_att, report
