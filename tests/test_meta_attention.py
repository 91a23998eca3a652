"""FedAMN's agent-side attention meta-network (participant.meta_attention): the mix it starts an agent from, checked
by hand at its initial Θ, the fixed points any Θ must keep, meta-training that finds the useful peer, and Θ
kept across rounds."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from torch import nn

from models.datasets import Dataset
from models.serialization import load_file, save_file
from models.training import evaluate_arrays, train_sgd
from models.weights import NamedArrays, float_part, to_arrays
from models.zoo import build_model
from participant.meta_attention import SKETCH_SIZE, attend, attention_start, build_groups, initial_theta

CPU = torch.device("cpu")


def random_model(name: str, seed: int) -> NamedArrays:
    torch.manual_seed(seed)
    return to_arrays(build_model(name))


def stack(models: list[NamedArrays]) -> NamedArrays:
    return {name: np.stack([m[name] for m in models]) for name in float_part(models[0])}


def noise_data(shape: tuple[int, ...], n: int = 40, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset(rng.normal(size=(n, *shape)).astype(np.float32), rng.integers(0, 10, n))


def separable_data(n: int, seed: int = 0) -> Dataset:
    """Four classes of 40-sample signals, each a fixed random template plus a little noise (MNIST-1D shape)."""
    templates = np.random.default_rng(99).normal(size=(4, 1, 40))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    return Dataset((templates[y] + 0.3 * rng.normal(size=(n, 1, 40))).astype(np.float32), y)


def start(model, own, peers, global_model, data, state_path, epochs=0, lr=0.01, seed=0):
    return attention_start(
        model, own, peers, global_model, data, epochs=epochs, lr=lr, batch_size=16, seed=seed, device=CPU,
        state_path=state_path,
    )  # fmt: skip


def test_peers_and_global_equal_to_own_give_own_back_with_its_integer_buffers(tmp_path):
    model = build_model("digits_cnn")
    own = to_arrays(model)
    own["features.1.num_batches_tracked"] = np.array(7, np.int64)
    w_att, report = start(model, own, stack([own] * 3), float_part(own), noise_data((1, 8, 8)), tmp_path / "t", 1)
    untouched = to_arrays(model)
    assert all(np.array_equal(untouched[n], a) for n, a in own.items() if n != "features.1.num_batches_tracked")
    assert untouched["features.1.num_batches_tracked"] == 0  # meta-training changed nothing in the base network
    assert report.steps == 3 and math.isfinite(report.loss)
    assert report.peer_weights == pytest.approx([1 / 3] * 3) and sum(report.peer_weights) == pytest.approx(1)
    assert 0 <= report.global_weight <= 1
    assert list(w_att) == list(own)
    for name, a in own.items():
        assert w_att[name].dtype == a.dtype and w_att[name].shape == a.shape
        np.testing.assert_allclose(w_att[name], a, rtol=1e-6, atol=1e-7)
    assert w_att["features.1.num_batches_tracked"] == 7 and w_att["features.4.num_batches_tracked"] == 0


def test_peers_and_global_all_equal_give_that_model_whatever_theta(tmp_path):
    model = build_model("digits_cnn")
    own, shared = random_model("digits_cnn", 1), random_model("digits_cnn", 2)
    path = tmp_path / "theta.safetensors"
    start(model, own, stack([shared] * 4), float_part(shared), noise_data((1, 8, 8)), path)
    theta, _ = load_file(path)
    rng = np.random.default_rng(0)
    save_file(path, {k: rng.normal(scale=3.0, size=a.shape).astype(np.float32) for k, a in theta.items()})
    w_att, report = start(model, own, stack([shared] * 4), float_part(shared), noise_data((1, 8, 8)), path)
    for name in float_part(own):
        np.testing.assert_allclose(w_att[name], shared[name], rtol=1e-5, atol=1e-6)
    assert abs(report.global_weight - 0.5) > 0.05  # the random Θ was used (its initial b = 0 gives ½)


def numpy_sketch(group: str, vector: np.ndarray) -> np.ndarray:
    """The count-sketch as the module docstring specifies it, written independently."""
    if vector.size <= SKETCH_SIZE:
        return np.pad(vector, (0, SKETCH_SIZE - vector.size)).astype(np.float64)
    rng = np.random.default_rng(zlib.crc32(group.encode()))
    bucket = rng.integers(0, SKETCH_SIZE, vector.size)
    sign = 1 - 2 * rng.integers(0, 2, vector.size)
    out = np.zeros(SKETCH_SIZE)
    np.add.at(out, bucket, sign * vector.astype(np.float64))
    return out


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max())
    return e / e.sum()


def test_initial_attention_is_softmax_of_cosines_of_the_sketched_models(tmp_path):
    """Group "0" (45 values) is count-sketched, group "2" (12 values) is used as it is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 2))
    rows = [to_arrays(nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 2))) for _ in range(5)]
    own, global_model, peers = rows[0], rows[1], rows[2:]
    data = Dataset(np.zeros((4, 8), np.float32), np.zeros(4, np.int64))
    w_att, report = start(model, own, stack(peers), global_model, data, tmp_path / "t")

    alphas, betas_g = [], []
    for group in ("0", "2"):
        names = [f"{group}.weight", f"{group}.bias"]

        def vec(m, names=names):
            return np.concatenate([m[n].ravel() for n in names])

        sketch = {id(m): numpy_sketch(group, vec(m) - vec(global_model)) for m in [own, *peers]}
        alpha = softmax(np.array([unit(sketch[id(own)]) @ unit(sketch[id(p)]) for p in peers]))
        mixed_sketch = sum(a * sketch[id(p)] for a, p in zip(alpha, peers, strict=True))
        beta_g = 1 / (1 + math.exp(unit(sketch[id(own)]) @ unit(mixed_sketch)))  # softmax of (cosine, b = 0)
        mixed = sum(a * vec(p) for a, p in zip(alpha, peers, strict=True))
        np.testing.assert_allclose(vec(w_att), (1 - beta_g) * mixed + beta_g * vec(global_model), rtol=1e-5)
        alphas.append(alpha)
        betas_g.append(beta_g)
    np.testing.assert_allclose(report.peer_weights, np.mean(alphas, axis=0), rtol=1e-5)
    assert report.global_weight == pytest.approx(np.mean(betas_g), rel=1e-5)
    assert not np.allclose(alphas[0], 1 / 3, atol=1e-3)  # a case where the cosines matter


def test_a_weight_too_small_for_float32s_normal_range_is_zero_and_the_mix_the_same():
    """A sharp attention (a softmax of logits far apart) gives subnormal weights, which x86 multiplies on a slow
    path: they reach the mix as 0."""
    own, global_model = random_model("mnist1d_cnn", 1), random_model("mnist1d_cnn", 2)
    peers = stack([random_model("mnist1d_cnn", s) for s in range(3, 9)])
    groups = build_groups(own, peers, global_model, CPU)
    seeded = torch.Generator().manual_seed(5)
    theta = {k: torch.randn_like(t, generator=seeded) for k, t in initial_theta(groups, CPU).items()}

    def logits(group, theta):  # noqa: ANN001, ANN202
        t = {key: theta[f"{group.name}/{key}"] for key in ("A_q", "A_k")}
        return (group.peer_features @ t["A_k"].T) @ (t["A_q"] @ group.own_feature) / math.sqrt(SKETCH_SIZE)

    first = logits(groups[0], theta)
    sharp = math.sqrt(95 / float(first.max() - first.min()))  # A_q and A_k scaled: the logits by its square
    theta = {k: t * sharp for k, t in theta.items()}  # the first group's least weight about e^-95: subnormal
    tiny, zeroed = torch.finfo(torch.float32).tiny, 0
    for group in groups:
        softmax = torch.softmax(logits(group, theta), dim=0)
        _, alpha, _ = attend(group, theta)
        assert not bool(((alpha > 0) & (alpha < tiny)).any())
        zeroed += int(((softmax > 0) & (softmax < tiny)).sum())
        torch.testing.assert_close(alpha, torch.where(softmax < tiny, 0.0, softmax), rtol=0, atol=0)
    assert zeroed > 0, "no subnormal weight to test: sharpen theta"


def test_attention_weights_are_distributions_for_any_theta():
    own, global_model = random_model("mnist1d_cnn", 1), random_model("mnist1d_cnn", 2)
    peers = stack([random_model("mnist1d_cnn", s) for s in range(3, 9)])
    groups = build_groups(own, peers, global_model, CPU)
    theta = {k: torch.randn_like(t) * 5 for k, t in initial_theta(groups, CPU).items()}
    for group in groups:
        _, alpha, beta = attend(group, theta)
        assert alpha.shape == (6,) and beta.shape == (2,)
        assert float(alpha.min()) >= 0 and float(beta.min()) >= 0
        assert float(alpha.sum()) == pytest.approx(1, abs=1e-6) and float(beta.sum()) == pytest.approx(1, abs=1e-6)


def test_meta_training_moves_attention_to_the_peer_that_fits_the_data(tmp_path):
    train = separable_data(200)
    torch.manual_seed(0)
    good_model = build_model("mnist1d_cnn")
    train_sgd(good_model, train, epochs=15, batch_size=16, lr=0.05, momentum=0.9, seed=0, device=CPU)
    good = to_arrays(good_model)
    assert evaluate_arrays("mnist1d_cnn", good, train, CPU)["accuracy"] > 0.95
    own, global_model = random_model("mnist1d_cnn", 10), float_part(random_model("mnist1d_cnn", 11))
    peers = stack([good, random_model("mnist1d_cnn", 12), random_model("mnist1d_cnn", 13)])
    model = build_model("mnist1d_cnn")

    before, first = start(model, own, peers, global_model, train, tmp_path / "fresh")
    after, trained = start(model, own, peers, global_model, train, tmp_path / "trained", epochs=2, lr=0.05)
    assert first.peer_weights[0] < 0.4  # at the initial Θ the good peer is not singled out
    assert trained.peer_weights[0] > 0.9 and trained.global_weight < 0.1
    assert trained.steps == 2 * 13
    loss_before = evaluate_arrays("mnist1d_cnn", before, train, CPU)["loss"]
    loss_after = evaluate_arrays("mnist1d_cnn", after, train, CPU)["loss"]
    assert loss_after < 0.1 * loss_before
    assert trained.loss < loss_before


def test_theta_is_kept_bit_for_bit_across_calls_and_peer_counts(tmp_path):
    model = build_model("mnist1d_cnn")
    own, global_model = random_model("mnist1d_cnn", 1), float_part(random_model("mnist1d_cnn", 2))
    peers = stack([own, random_model("mnist1d_cnn", 3), random_model("mnist1d_cnn", 4)])
    data, path = separable_data(48), tmp_path / "theta.safetensors"
    trained, _ = start(model, own, peers, global_model, data, path, epochs=2, lr=0.05)
    again, report = start(model, own, peers, global_model, data, path)
    assert report.steps == 0 and math.isnan(report.loss)
    for name, a in trained.items():
        assert np.array_equal(again[name], a), name
    fresh, _ = start(model, own, peers, global_model, data, tmp_path / "other")
    assert not all(np.array_equal(fresh[n], trained[n]) for n in float_part(own))  # training changed Θ

    more = stack([random_model("mnist1d_cnn", s) for s in range(5, 10)])
    _, five = start(model, own, more, global_model, data, path, epochs=1)
    assert len(five.peer_weights) == 5 and sum(five.peer_weights) == pytest.approx(1)


@pytest.mark.parametrize("content", ["another model", "garbage"])
def test_a_theta_file_that_does_not_fit_starts_fresh(tmp_path, caplog, content):
    path = tmp_path / "theta.safetensors"
    if content == "garbage":
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    else:
        digits = random_model("digits_cnn", 1)
        start(build_model("digits_cnn"), digits, stack([digits] * 2), float_part(digits), noise_data((1, 8, 8)), path)
    model = build_model("mnist1d_cnn")
    own, global_model = random_model("mnist1d_cnn", 1), float_part(random_model("mnist1d_cnn", 2))
    peers = stack([random_model("mnist1d_cnn", s) for s in (3, 4)])
    w_att, _ = start(model, own, peers, global_model, separable_data(8), path)
    fresh, _ = start(model, own, peers, global_model, separable_data(8), tmp_path / "fresh")
    assert all(np.array_equal(w_att[n], fresh[n]) for n in own)
    assert "starting from the initial attention" in caplog.text
    assert set(load_file(path)[0]) == set(load_file(tmp_path / "fresh")[0])  # replaced by this model's Θ


def test_inputs_that_do_not_fit_the_model_are_refused_with_the_tensor_named(tmp_path):
    model = build_model("mnist1d_cnn")
    own = random_model("mnist1d_cnn", 1)
    peers = stack([own, own])
    data = separable_data(8)
    with pytest.raises(ValueError, match="classifier.bias"):
        start(model, own, {k: v for k, v in peers.items() if k != "classifier.bias"}, float_part(own), data, tmp_path)
    with pytest.raises(ValueError, match="global model lacks tensor 'classifier.weight'"):
        bad_global = {**float_part(own), "classifier.weight": np.zeros((3, 3), np.float32)}
        start(model, own, peers, bad_global, data, tmp_path / "t")
    peers["features.0.weight"][1, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="'features.0' hold NaN"):
        start(model, own, peers, float_part(own), data, tmp_path / "t")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_gives_the_cpu_mix(tmp_path):
    model = build_model("digits_cnn")
    own, global_model = random_model("digits_cnn", 1), float_part(random_model("digits_cnn", 2))
    peers = stack([random_model("digits_cnn", s) for s in range(3, 7)])
    data = noise_data((1, 8, 8))
    kwargs = dict(epochs=2, lr=0.01, batch_size=16, seed=0)
    on_cpu, cpu_report = attention_start(
        model, own, peers, global_model, data, **kwargs, device=CPU, state_path=tmp_path / "cpu"
    )
    on_gpu, gpu_report = attention_start(
        model, own, peers, global_model, data, **kwargs, device=torch.device("cuda"), state_path=tmp_path / "gpu"
    )
    assert gpu_report.peer_weights == pytest.approx(cpu_report.peer_weights, abs=1e-3)
    for name, a in on_cpu.items():
        np.testing.assert_allclose(on_gpu[name], a, rtol=1e-3, atol=1e-4)
