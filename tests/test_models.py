"""Model zoo, named arrays, deltas and the zero-copy safetensors reader."""

import hashlib
import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from models.datasets import load_digits
from models.serialization import (
    SerializationError,
    dumps,
    float32_header,
    float32_region,
    load_file,
    loads,
    save_file,
)
from models.tasks import CLASSIFIERS, YOLO_YAMLS, task_of
from models.training import evaluate, on_device, proximal, train_sgd
from models.weights import TensorSpec, delta, flatten, float_part, load_arrays, spec_of, to_arrays, unflatten
from models.zoo import MODELS, build_model, input_shape


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_fedavg_paper_model_sizes():
    assert n_params(build_model("fedavg_cnn")) == 1_663_370  # McMahan et al. 2017, CNN
    assert n_params(build_model("mlp_mnist")) == 199_210  # the paper's 2NN
    out = build_model("fedavg_cnn")(torch.zeros(2, *input_shape("fedavg_cnn")))
    assert out.shape == (2, 10)


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match="digits_cnn"):
        build_model("resnet")
    with pytest.raises(ValueError, match="yolo11n"):
        task_of("resnet")


def test_the_torch_free_task_table_names_exactly_the_zoo():
    assert set(MODELS) == {*CLASSIFIERS, *YOLO_YAMLS}
    assert [task_of(name) for name in ("digits_cnn", "yolo11n")] == ["classify", "detect"]


def test_digits_cnn_learns_centrally():
    torch.manual_seed(0)
    train, test = load_digits(seed=0)
    model = build_model("digits_cnn")
    train_sgd(model, train, epochs=4, batch_size=32, lr=0.05, momentum=0.9, seed=0, device=torch.device("cpu"))
    assert evaluate(model, test, torch.device("cpu"))["accuracy"] >= 0.93


def test_integer_buffers_are_kept_out_of_deltas_and_survive_round_trips():
    model = build_model("digits_cnn")
    arrays = to_arrays(model)
    ints = [k for k, v in arrays.items() if not np.issubdtype(v.dtype, np.floating)]
    assert ints and all(k.endswith("num_batches_tracked") and arrays[k].shape == () for k in ints)
    local = {k: (v + 1 if np.issubdtype(v.dtype, np.floating) else v + 7) for k, v in arrays.items()}
    d = delta(local, arrays)
    assert set(d) == set(float_part(arrays)) and all(v.dtype == np.float32 for v in d.values())
    applied = {k: (v + d[k]).astype(v.dtype) if k in d else v for k, v in arrays.items()}
    assert all(np.array_equal(applied[k], arrays[k]) for k in ints)  # the global keeps its own counts
    np.testing.assert_allclose(applied["classifier.0.bias"], arrays["classifier.0.bias"] + 1)
    restored, _ = loads(dumps(applied))
    load_arrays(model, restored)
    assert model.state_dict()["features.1.num_batches_tracked"].shape == ()


def test_load_arrays_names_the_mismatching_key():
    model = build_model("digits_cnn")
    arrays = to_arrays(model)
    arrays["classifier.2.bias"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="classifier.2.bias"):
        load_arrays(model, arrays)


def test_flatten_unflatten_round_trip_in_spec_order():
    arrays = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(4, np.float32)}
    spec = spec_of(arrays)
    back = unflatten(flatten(arrays, spec), spec)
    assert all(np.array_equal(back[k], arrays[k]) for k in arrays)


def test_loads_is_zero_copy_and_float32_region_is_one_flat_view():
    arrays = {
        "w": np.random.default_rng(0).standard_normal((300, 100)).astype(np.float32),
        "b": np.zeros(100, np.float32),
    }
    data = bytearray(dumps(arrays, {"k": "v"}))
    loaded, meta = loads(data)
    assert meta == {"k": "v"} and np.shares_memory(loaded["w"], np.frombuffer(data, np.uint8))
    vector, spec, _ = float32_region(data)
    assert vector.size == 30_100 and np.shares_memory(vector, np.frombuffer(data, np.uint8))
    back = unflatten(vector, spec)
    assert np.array_equal(back["w"], arrays["w"])


@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=5, unique=True),
       st.lists(st.integers(0, 5), min_size=5, max_size=5))  # fmt: skip
@settings(max_examples=40, deadline=None)
def test_a_kept_model_is_written_as_dumps_would_write_it(names, sizes):
    """The server's model store writes a float32 vector after its own header (``float32_header``): byte for
    byte what ``dumps`` makes of the same tensors, names in any script."""
    spec = tuple(TensorSpec(n, "f4", (size, 2)) for n, size in zip(sorted(names), sizes[: len(names)], strict=True))
    vector = np.random.default_rng(len(names)).standard_normal(sum(2 * s.shape[0] for s in spec)).astype(np.float32)
    assert float32_header(spec) + vector.tobytes() == dumps(unflatten(vector, spec))


def test_float32_header_refuses_a_layout_safetensors_would_reorder():
    spec = (TensorSpec("b", "f4", (2,)), TensorSpec("a", "f4", (2,)))
    with pytest.raises(ValueError, match="by name"):
        float32_header(spec)


def test_float32_region_refuses_other_dtypes():
    with pytest.raises(SerializationError, match="float32"):
        float32_region(dumps({"n": np.zeros(2, np.int64)}))


def _raw(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 1 << 40) + b"{}", "does not fit"),
        (struct.pack("<Q", 3) + b"{{{", "not JSON"),
        (_raw({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)), "unsupported dtype"),
        (_raw({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)), "does not match"),
        (_raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12)), "no tensor accounts"),
        (
            _raw(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                bytes(12),
            ),
            "overlaps",
        ),
        (_raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}}, bytes(8)), "offsets outside the data"),
        (_raw({"a": "nope"}, b""), "malformed entry"),
        (_raw({"__metadata__": {"k": 1}}, b""), "strings to strings"),
    ],
)
def test_malformed_safetensors_are_refused_with_a_reason(payload, reason):
    with pytest.raises(SerializationError, match=reason):
        loads(payload)


def test_nan_values_round_trip_unchanged_because_validation_is_elsewhere():
    arrays, _ = loads(dumps({"x": np.array([np.nan, 1.0], np.float32)}))
    assert np.isnan(arrays["x"][0])


def test_twenty_re_serializations_in_any_insertion_order_give_one_sha256_that_safetensors_reads(tmp_path):
    """A model published again must match the SHA-256 its signed task names: safetensors writes metadata in
    an order that changes between calls, ``dumps`` must not."""
    rng = np.random.default_rng(0)
    kinds = (("weight", np.float32), ("count", np.int64), ("half", np.float16))
    arrays = {f"layer{i}.{k}": rng.standard_normal((3, i + 1)).astype(t) for i in range(6) for k, t in kinds}
    metadata = {key: f"value-{key}" for key in ("model", "version", "round", "run_id", "kind", "scope", "z", "a")}
    digests, payload = set(), b""
    for _ in range(20):  # fresh dicts, fresh arrays, every time in another insertion order
        names, keys = rng.permutation(list(arrays)), rng.permutation(list(metadata))
        payload = dumps({str(n): arrays[n].copy() for n in names}, {str(k): metadata[k] for k in keys})
        digests.add(hashlib.sha256(payload).hexdigest())
    assert len(digests) == 1
    assert struct.unpack_from("<Q", payload)[0] % 8 == 0  # the data starts 8-aligned, as safetensors pads it
    back, meta = loads(payload)
    assert meta == metadata and all(np.array_equal(back[n], a) and back[n].dtype == a.dtype for n, a in arrays.items())
    (tmp_path / "m.safetensors").write_bytes(payload)
    with safe_open(tmp_path / "m.safetensors", framework="np") as handle:  # the library's own reader, too
        assert handle.metadata() == metadata and np.array_equal(handle.get_tensor("layer5.half"), arrays["layer5.half"])


def test_save_file_is_atomic_and_load_file_copies(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(path, {"x": np.ones(3, np.float32)})
    arrays, _ = load_file(path)
    arrays["x"][0] = 5  # a private, writable copy
    assert list(tmp_path.iterdir()) == [path]


def test_fedprox_proximal_term_keeps_local_training_closer_to_the_start_model():
    train, _ = load_digits(seed=0)
    distances = {}
    for mu in (0.0, 10.0):
        torch.manual_seed(0)
        model = build_model("digits_cnn", num_classes=10)
        start = [p.detach().clone() for p in model.parameters()]
        train_sgd(model, train.subset(np.arange(400)), epochs=2, batch_size=32, lr=0.05, momentum=0.9, seed=0,
                  device=torch.device("cpu"), prox_mu=mu)  # fmt: skip
        with torch.no_grad():
            distances[mu] = float(proximal(model, start))
    assert distances[10.0] < 0.5 * distances[0.0], distances


def test_the_proximal_term_pulls_toward_a_given_anchor_instead_of_the_start():
    """Ditto's personal model is pulled toward the global model, not toward where it started."""
    train, _ = load_digits(seed=0)
    data = train.subset(np.arange(200))
    torch.manual_seed(0)
    start = build_model("digits_cnn", num_classes=10)
    zeros = {name: np.zeros(tuple(p.shape), np.float32) for name, p in start.named_parameters()}
    norms = {}
    for anchor in (None, zeros):
        model = build_model("digits_cnn", num_classes=10)
        model.load_state_dict(start.state_dict())
        train_sgd(model, data, epochs=2, batch_size=32, lr=0.05, momentum=0.9, seed=0, device=torch.device("cpu"),
                  prox_mu=5.0, anchor=anchor)  # fmt: skip
        norms["start" if anchor is None else "zeros"] = float(sum((p.detach() ** 2).sum() for p in model.parameters()))
    assert norms["zeros"] < 0.5 * norms["start"], norms


def test_fedprox_strategy_sends_mu_in_the_round_task_and_aggregates_like_fedavg():
    from flcore.strategies import build_strategy
    from flcore.strategies.base import TrainPlan
    from protocol.messages import RecipeRecord, TrainSettings

    prox = build_strategy({"name": "fedprox", "mu": 0.1})
    paces = {"fast": 1.0, "slow": 10.0}
    proximal = RecipeRecord("proximal", {"mu": 0.1})
    asked = TrainPlan(TrainSettings(epochs=3, recipes=(proximal,)))
    assert prox.configure_train(TrainSettings(epochs=3), 1, paces) == asked
    assert build_strategy({"name": "fedavg"}).configure_train(TrainSettings(), 1, paces).shared.recipes == ()
    with pytest.raises(ValueError, match="strategy.mu must be >= 0"):
        build_strategy({"name": "fedprox", "mu": -1})
    with pytest.raises(ValueError, match=r"strategy.min_work must be in \(0, 1\]"):
        build_strategy({"name": "fedprox", "min_work": 0})


def test_fedprox_partial_work_gives_agents_slower_than_the_median_the_share_that_matches_it():
    from flcore.strategies.fedprox import partial_work

    paces = {"a": 1.0, "b": 2.0, "c": 4.0, "d": 10.0}  # median 3 seconds per unit of work
    assert partial_work(paces, min_work=0.1) == {"c": 0.75, "d": 0.3}
    assert partial_work(paces, min_work=0.5) == {"c": 0.75, "d": 0.5}
    assert partial_work({}, min_work=0.1) == {} and partial_work({"a": 5.0}, min_work=0.1) == {}


def test_train_sgd_with_partial_work_runs_that_share_of_the_mini_batches():
    train, _ = load_digits(test_fraction=0.2, seed=0)
    steps = []
    for work in (1.0, 0.25, 0.001):
        model = build_model("digits_cnn", num_classes=10)
        calls: list[int] = []
        model.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        train_sgd(model, train.subset(np.arange(400)), epochs=2, batch_size=32, lr=0.05, momentum=0.9, seed=0,
                  device=torch.device("cpu"), work=work)  # fmt: skip
        steps.append(len(calls))
    assert steps == [26, 7, 1]  # 13 mini-batches per epoch; ceil(0.25 * 26) = 7; never less than one


@pytest.mark.parametrize(
    ("name", "weights"),
    [  # seed 004's layers: MLP 256-128-64; CNN conv 32, conv 64 (3 wide, padded 1), two 2x pools, FC 100
        ("thesis_mlp_digits", [(256, 64), (128, 256), (64, 128), (10, 64)]),
        ("thesis_mlp_mnist1d", [(256, 40), (128, 256), (64, 128), (10, 64)]),
        ("thesis_cnn_digits", [(32, 1, 3, 3), (64, 32, 3, 3), (100, 64 * 2 * 2), (10, 100)]),
        ("thesis_cnn_mnist1d", [(32, 1, 3), (64, 32, 3), (100, 64 * 10), (10, 100)]),
    ],
)
def test_the_thesis_models_have_its_layers_and_no_batchnorm(name, weights):
    model = build_model(name)
    assert [tuple(p.shape) for n, p in model.named_parameters() if n.endswith("weight")] == weights
    assert not list(model.buffers())  # no BatchNorm statistics (or any other buffer): plain weights only
    assert model(torch.zeros(3, *input_shape(name))).shape == (3, 10)


def test_on_device_leaves_a_model_already_there_untouched_and_moves_one_that_is_not():
    model = build_model("digits_cnn", num_classes=10)
    before = [p.data_ptr() for p in model.parameters()]
    assert on_device(model, torch.device("cpu")) is model
    assert [p.data_ptr() for p in model.parameters()] == before
    moved = on_device(model, torch.device("meta"))  # a device it is not on: moved, as model.to does
    assert {p.device.type for p in moved.parameters()} == {"meta"}
