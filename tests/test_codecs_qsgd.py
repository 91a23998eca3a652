"""The qsgd4 codec (QSGD, 4 bits a value): its per-value error bound, its unbiasedness over many seeded
draws, its size against fp32, forged payloads refused or bounded, and a federation over a real broker."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from flcore.update import UpdateMeta, UpdateRejected, parse_update
from models.serialization import dumps
from models.weights import RUNNING_STATISTICS, float_part, spec_of, to_arrays
from models.zoo import build_model
from protocol.codecs import CODECS, Codec, CodecError, decode, encode
from protocol.codecs.qsgd import BUCKET, LEVELS, NORMS
from tests.fedharness import Federation
from tests.fixtures import FP32_UPDATE_BYTES, PROPERTY, bounded, changes, mutated, round_trip

QSGD4 = Codec.parse("qsgd4")


def bucket_norms(x: np.ndarray) -> np.ndarray:
    """Each value's bucket norm: the tensor cut into BUCKET-value pieces in order."""
    flat = x.reshape(-1).astype(np.float64)
    return np.concatenate(
        [np.full(len(b), np.linalg.norm(b)) for b in np.split(flat, range(BUCKET, flat.size, BUCKET))]
    )


@PROPERTY
@given(changes())
def test_qsgd4_errs_by_less_than_one_level_per_value(change):
    decoded = round_trip(change, "qsgd4")
    for name, x in change.items():
        if name.endswith(RUNNING_STATISTICS):
            assert np.array_equal(decoded[name], x)
            continue
        step = bucket_norms(x) / LEVELS
        assert (np.abs(decoded[name].reshape(-1) - x.reshape(-1)) <= step * (1 + 1e-5) + 1e-30).all()


def test_qsgd4_is_unbiased_over_many_draws():
    rng = np.random.default_rng(7)
    change = {"conv.weight": rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.01,
              "fc.weight": rng.standard_normal((10, 100)).astype(np.float32),
              "fc.bias": np.float32([0.5, -2.0, 0])}  # fmt: skip
    draws = 400
    total = {name: np.zeros(x.shape) for name, x in change.items()}
    for seed in range(draws):
        for name, got in decode(encode(change, Codec("qsgd4", seed=seed)), QSGD4, spec_of(change)).items():
            total[name] += got
    assert not np.array_equal(encode(change, Codec("qsgd4", seed=1))["@values"], encode(change, QSGD4)["@values"])
    for name, x in change.items():
        step = bucket_norms(x).reshape(x.shape) / LEVELS  # a draw's value is one of two levels `step` apart
        # the mean of `draws` Bernoulli(p) steps has a standard deviation of at most step / 2 / sqrt(draws)
        assert (np.abs(total[name] / draws - x) <= 5 * step / 2 / np.sqrt(draws) + 1e-7).all(), name
        assert np.abs(total[name] / draws - x).mean() < 0.5 * step.mean() / np.sqrt(draws), (
            name
        )  # ~N(0, s <= step/2): 0.8 s


def test_the_same_change_encodes_the_same_way():
    change = {"w": np.linspace(-1, 1, 1001, dtype=np.float32)}
    assert np.array_equal(encode(change, QSGD4)["@values"], encode(change, Codec.parse("qsgd4"))["@values"])


def test_qsgd4_is_about_eight_times_smaller_than_fp32_on_the_digits_cnn():
    change = {
        n: np.full(a.shape, 0.01, np.float32) for n, a in float_part(to_arrays(build_model("digits_cnn"))).items()
    }
    fp32, qsgd = len(dumps(encode(change, Codec()))), len(dumps(encode(change, QSGD4)))
    assert fp32 > 4 * 38_000  # the float32 change, 38,476 values
    assert 7.5 < fp32 / qsgd < 8  # 4 bits a value, a float32 norm per 512 values, the statistics dense


def test_every_lossy_codec_sends_the_running_statistics_exactly():
    change = {"bn.running_mean": np.float32([1e-7, -3.0]), "bn.running_var": np.float32([-1e-9, 5.0]),
              "conv.weight": np.linspace(-1, 1, 40, dtype=np.float32).reshape(4, 10)}  # fmt: skip
    lossy = CODECS.where(lambda plugin: plugin.lossy)
    assert "qsgd4" in lossy and "fp32" not in lossy
    for name in lossy:
        codec = Codec(name)
        decoded = decode(encode(change, codec), codec, spec_of(change))
        assert all(np.array_equal(decoded[n], change[n]) for n in ("bn.running_mean", "bn.running_var")), name


CHANGE = {"conv.weight": np.linspace(-1, 1, 25, dtype=np.float32).reshape(5, 5), "bn.running_var": np.ones(4, "f4")}
GOOD = encode(CHANGE, QSGD4)


@pytest.mark.parametrize(
    "replaced, reason",
    [
        ({"@values": GOOD["@values"].astype(np.int8)}, "@values is int8, expected uint8"),
        ({"@values": np.full(12, 0x88, np.uint8)}, r"@values has shape \(12,\), expected \(13,\)"),
        ({"@values": np.full(14, 0x88, np.uint8)}, r"expected \(13,\)"),
        ({"@values": np.full((13, 1), 0x88, np.uint8)}, "expected"),
        ({"@values": np.full(13, 0x80, np.uint8)}, r"levels must be in \[-7, 7\]"),  # nibble 0: level -8
        ({"@values": np.full(13, 0x98, np.uint8)}, "pad nibble must be 8"),  # 25 values: the 26th must be level 0
        ({NORMS: np.float32([np.nan])}, "norms must be finite and >= 0"),
        ({NORMS: np.float32([np.inf])}, "norms must be finite and >= 0"),
        ({NORMS: np.float32([-1.0])}, "norms must be finite and >= 0"),
        ({NORMS: np.float64([1.0])}, "@norms is float64, expected float32"),
        ({NORMS: np.float32([1.0, 1.0])}, r"@norms has shape \(2,\), expected \(1,\)"),
        ({NORMS: None}, "missing '@norms'"),
        ({"@scales": np.ones(1, "f4")}, "unexpected '@scales'"),
    ],
)
def test_forged_qsgd4_payloads_are_refused_with_one_short_reason(replaced, reason):
    payload = {n: a for n, a in {**GOOD, **replaced}.items() if a is not None}
    with pytest.raises(CodecError, match=reason):
        decode(payload, QSGD4, spec_of(CHANGE))


def test_a_huge_norm_decodes_to_finite_values_no_larger_than_it():
    biggest = np.finfo(np.float32).max
    values = np.full(13, 0xFF, np.uint8)  # level 7 everywhere
    values[-1] = 0x8F  # but the pad
    payload = {**GOOD, NORMS: np.float32([biggest]), "@values": values}
    decoded = decode(payload, QSGD4, spec_of(CHANGE))["conv.weight"]
    assert np.isfinite(decoded).all() and (np.abs(decoded) <= biggest).all() and decoded.max() == biggest


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated([dumps(GOOD, UpdateMeta(1, 1, 10, 0.5, codec="qsgd4").to_metadata())]))
def test_mutated_qsgd4_updates_raise_only_update_rejected(payload):
    check = partial(parse_update, expected_spec=spec_of(CHANGE), round_number=1, model_version=1, codec=QSGD4)
    bounded(check, payload, (UpdateRejected,))


def test_a_federation_trains_with_qsgd4_over_a_broker_at_an_eighth_of_the_bytes(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=3, agents=2, strategy={"name": "fedavg"}, codec="qsgd4")
    _, server_thread = fed.start_with_server()
    try:
        server_thread.join(120)
        assert not server_thread.is_alive(), "the federation did not finish"
    finally:
        fed.close()
    metrics = fed.metrics()
    assert [m.round for m in metrics] == [1, 2, 3]
    assert all(sorted(m.accepted) == ["agent-01", "agent-02"] and m.rejected == [] for m in metrics)
    assert metrics[-1].bytes_up / 2 < FP32_UPDATE_BYTES / 7.5 * 1.1  # sealing and chunk headers on top
    assert metrics[-1].eval["accuracy"] > 0.85, [m.eval["accuracy"] for m in metrics]
    assert not (fed.agents[0].config.state_dir / "residual.safetensors").exists()  # unbiased: no error feedback
