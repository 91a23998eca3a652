"""Update codecs (docs/results/codecs.md): each codec's error bound, top-k's error feedback and its
durability, hostile payloads refused with a reason, and the negotiation through server.toml, the signed
round task and the sealed update header."""

from __future__ import annotations

import json
import os
from functools import partial

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_server.config import load_server_config
from broker_server.rounds.accept import largest_update_bytes
from broker_server.rounds.engine import RoundEngine
from flcore.update import UpdateMeta, UpdateMetaError, UpdateRejected, parse_update
from models.serialization import dumps
from models.weights import RUNNING_STATISTICS, float_part, spec_of
from protocol import codecs
from protocol.codecs import Codec, CodecError, ErrorFeedback, compress, decode, encode
from protocol.config import ConfigError
from protocol.messages import MessageError, RoundTask
from protocol.transfer import Completed
from security.envelope import NO_DIGEST, Manifest
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml, round_task
from tests.fixtures import PROPERTY, bounded, changes, mutated, round_trip

LOSSY = ["fp16", "int8", "int8:channel", "topk:0.1"]


# the codecs' bounds ---------------------------------------------------------------------------------
@PROPERTY
@given(changes())
def test_fp32_is_exact_and_fp16_within_half_a_unit_in_the_last_place(change):
    assert all(np.array_equal(round_trip(change, "fp32")[n], change[n]) for n in change)
    decoded = round_trip(change, "fp16")
    for name, x in change.items():
        assert (np.abs(decoded[name] - x) <= np.abs(x) * 2.0**-11 + 2.0**-25).all()


@PROPERTY
@given(changes(), st.booleans())
def test_int8_errs_by_at_most_half_a_scale_per_element(change, per_channel):
    decoded = round_trip(change, "int8:channel" if per_channel else "int8")
    for name, x in change.items():
        if name.endswith(RUNNING_STATISTICS):
            continue
        rows = x.reshape(x.shape[0], -1) if per_channel and x.ndim >= 2 else x.reshape(1, -1)
        half = np.abs(rows).max(axis=1, keepdims=True) / 127 / 2
        assert (np.abs(decoded[name].reshape(rows.shape) - rows) <= half * (1 + 1e-5) + 1e-30).all()


@PROPERTY
@given(changes(), st.floats(0.001, 1.0))
def test_topk_sends_exactly_the_k_largest_magnitudes(change, fraction):
    codec = Codec("topk", fraction=fraction)
    payload = encode(change, codec)
    coded = np.concatenate([change[n].reshape(-1) for n in sorted(change) if not n.endswith(RUNNING_STATISTICS)])
    k = codecs.top_count(coded.size, fraction)
    kept = np.zeros(coded.size, bool)
    kept[payload[codecs.INDICES]] = True
    assert kept.sum() == k == payload[codecs.VALUES].size
    assert np.array_equal(payload[codecs.VALUES], coded[kept])  # sent exactly, in index order
    assert np.abs(coded[kept]).min() >= np.abs(coded[~kept]).max(initial=0)
    decoded = decode(payload, codec, spec_of(change))
    assert sum(int(np.count_nonzero(decoded[n])) for n in change if not n.endswith(RUNNING_STATISTICS)) <= k


@pytest.mark.parametrize("text", LOSSY)
def test_running_statistics_travel_exactly_under_every_codec(text):
    change = {"bn.running_mean": np.float32([1e-7, -3.0]), "bn.running_var": np.float32([-1e-9, 5.0]),
              "conv.weight": np.linspace(-1, 1, 40, dtype=np.float32).reshape(4, 10)}  # fmt: skip
    decoded = round_trip(change, text)
    for name in ("bn.running_mean", "bn.running_var"):
        assert np.array_equal(decoded[name], change[name])


def test_the_codec_module_names_the_running_statistics_the_models_have():
    assert codecs.RUNNING_STATISTICS == RUNNING_STATISTICS  # protocol/ may not import models/


def test_codec_names_are_canonical_and_bad_ones_list_the_choices():
    assert [str(Codec.parse(t)) for t in ("fp32", "int8:channel", "topk:1e-2", "topk:1")] == [
        "fp32", "int8:channel", "topk:0.01", "topk:1.0"]  # fmt: skip
    for bad in ("int4", "topk:0", "topk:1.5", "topk:nan", "topk:", "int8:row", ""):
        with pytest.raises(CodecError, match="choose fp32, fp16, int8, int8:channel, topk:FRACTION or qsgd4"):
            Codec.parse(bad)


# error feedback -------------------------------------------------------------------------------------
def test_error_feedback_sends_every_change_eventually_and_survives_a_restart(tmp_path):
    rng = np.random.default_rng(0)
    shapes = {"a.weight": (20, 5), "b.bias": (7,), "bn.running_var": (5,)}
    steps = [{n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()} for _ in range(6)]
    codec = Codec.parse("topk:0.05")
    path = tmp_path / "agent" / "residual.safetensors"
    sent = {n: np.zeros(s, np.float64) for n, s in shapes.items()}
    uninterrupted = ErrorFeedback(tmp_path / "other.safetensors", "run-1")
    for change in steps:
        out = compress(change, codec, ErrorFeedback(path, "run-1"))  # a new object each round: a restart
        other = compress(change, codec, uninterrupted)
        for name in shapes:
            assert np.array_equal(out.sent[name], other.sent[name])
            sent[name] += out.sent[name]
        assert os.stat(path).st_mode & 0o777 == 0o600
    feedback = ErrorFeedback(path, "run-1")
    residual = feedback.residual(feedback.scope(codec, tuple(shapes.items())), tuple(shapes.items()))
    for name in shapes:
        total = sum(step[name].astype(np.float64) for step in steps)
        np.testing.assert_allclose(sent[name] + residual[name], total, atol=1e-5)
    assert not residual["bn.running_var"].any()  # running statistics are sent whole


@pytest.mark.parametrize(
    "later",
    [
        lambda path, change, codec: (ErrorFeedback(path, "run-2"), change, codec),  # the server's state was reset
        lambda path, change, codec: (ErrorFeedback(path, "run-1"), {"x": np.ones(9, np.float32)}, codec),  # new model
        lambda path, change, codec: (ErrorFeedback(path, "run-1"), change, Codec.parse("topk:0.5")),  # new codec
    ],
    ids=["new-run", "new-model", "new-codec"],
)
def test_error_feedback_starts_from_zero_for_another_run_model_or_codec(tmp_path, later):
    change, codec = {"x": np.arange(10, dtype=np.float32)}, Codec.parse("topk:0.1")
    compress(change, codec, ErrorFeedback(tmp_path / "r.safetensors", "run-1"))  # leaves 0..8 in the residual
    feedback, change, codec = later(tmp_path / "r.safetensors", change, codec)
    assert np.array_equal(compress(change, codec, feedback).sent["x"], compress(change, codec).sent["x"])


def test_an_unreadable_residual_file_starts_from_zero(tmp_path):
    (tmp_path / "r.safetensors").write_bytes(b"not safetensors")
    change, codec = {"x": np.arange(10, dtype=np.float32)}, Codec.parse("topk:0.1")
    assert compress(change, codec, ErrorFeedback(tmp_path / "r.safetensors", "run")).sent["x"][9] == 9


def test_fp32_and_int8_keep_no_residual(tmp_path):
    for text in ("fp32", "int8"):
        compress({"x": np.float32([0.3, 1.0])}, Codec.parse(text), ErrorFeedback(tmp_path / "r.safetensors", "r"))
    assert not (tmp_path / "r.safetensors").exists()


# hostile payloads -----------------------------------------------------------------------------------
CHANGE = {"conv.weight": np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6), "bn.running_var": np.ones(4, "f4")}


def _with(text: str, **replaced: object) -> tuple[dict, Codec]:
    codec = Codec.parse(text)
    payload = {**encode(CHANGE, codec), **replaced}
    return {n: a for n, a in payload.items() if a is not None}, codec


@pytest.mark.parametrize(
    "payload, reason",
    [
        (_with("int8", **{"@values": np.zeros(24, np.int16)}), "@values is int16, expected int8"),
        (_with("fp16", **{"@values": np.zeros(23, np.float16)}), r"@values has shape \(23,\), expected \(24,\)"),
        (_with("fp16", **{"@values": np.zeros((4, 6), np.float16)}), "expected"),
        (_with("int8", **{"@scales": np.float32([np.nan])}), "scales must be finite"),
        (_with("int8", **{"@scales": np.float32([np.inf])}), "scales must be finite"),
        (_with("int8", **{"@scales": np.float32([-1.0])}), "scales must be finite and >= 0"),
        (_with("int8:channel", **{"@scales": np.ones(1, np.float32)}), r"@scales has shape \(1,\), expected \(4,\)"),
        (_with("topk:0.25", **{"@indices": np.int32([0, 24]), "@values": np.ones(2, "f4")}), r"in \[0, 24\)"),
        (_with("topk:0.25", **{"@indices": np.int32([-1, 3]), "@values": np.ones(2, "f4")}), r"in \[0, 24\)"),
        (_with("topk:0.25", **{"@indices": np.int32([3, 3]), "@values": np.ones(2, "f4")}), "strictly increasing"),
        (_with("topk:0.25", **{"@indices": np.int32([5, 2]), "@values": np.ones(2, "f4")}), "strictly increasing"),
        (_with("topk:0.25", **{"@indices": np.arange(7, dtype=np.int32), "@values": np.ones(7, "f4")}), "at most 6"),
        (_with("topk:0.25", **{"@values": np.ones(5, "f4")}), r"@values has shape \(5,\), expected \(6,\)"),
        (_with("topk:0.25", **{"@indices": np.int32([5, -(2**31) + 3]), "@values": np.ones(2, "f4")}), r"in \[0, 24\)"),
        (_with("fp16", **{"@dense": None}), "missing '@dense'"),
        (_with("fp16", **{"@scales": np.ones(1, "f4")}), "unexpected '@scales'"),
        (_with("fp32", **{"conv.weight": np.zeros(24, "f4")}), "conv.weight is float32 .24,., expected"),
        (_with("fp32", **{"conv.weight": None}), "missing 'conv.weight'"),
        (_with("fp32", **{"conv.weight@x": np.zeros(1, "f4")}), "unexpected 'conv.weight@x'"),
    ],
)
def test_hostile_payloads_are_refused_with_one_short_reason(payload, reason):
    arrays, codec = payload
    with pytest.raises(CodecError, match=reason):
        decode(arrays, codec, spec_of(CHANGE))


UPDATE_META = UpdateMeta(round=1, base_version=1, samples=10, loss=0.5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated([dumps(encode(CHANGE, Codec.parse(t)), UpdateMeta(1, 1, 10, 0.5, codec=t).to_metadata())
                for t in ("int8:channel", "topk:0.25")]))  # fmt: skip
def test_mutated_encoded_updates_raise_only_update_rejected(payload):
    for text in ("int8:channel", "topk:0.25"):
        check = partial(parse_update, expected_spec=spec_of(CHANGE), round_number=1, model_version=1,
                        codec=Codec.parse(text))  # fmt: skip
        bounded(check, payload, (UpdateRejected,))


# negotiation ----------------------------------------------------------------------------------------
def test_a_round_task_from_before_codecs_means_fp32_and_a_bad_codec_is_refused():
    data = json.loads(round_task().to_json())
    del data["codec"]
    assert RoundTask.from_dict(data).codec == "fp32"
    assert RoundTask.from_dict({**data, "codec": "topk:1e-2"}).codec == "topk:0.01"
    with pytest.raises(MessageError, match="unknown codec 'zip'"):
        RoundTask.from_dict({**data, "codec": "zip"})


def test_the_update_header_names_its_codec_and_old_agents_mean_fp32():
    assert UpdateMeta.from_metadata({**UPDATE_META.to_metadata(), "codec": "none"}).codec == "fp32"
    assert (
        UpdateMeta.from_metadata(UpdateMeta(1, 1, 10, 0.5, codec="int8:channel").to_metadata()).codec == "int8:channel"
    )
    with pytest.raises(UpdateMetaError, match="unsupported-codec: zip"):
        UpdateMeta.from_metadata({**UPDATE_META.to_metadata(), "codec": "zip"})


@pytest.fixture
def federation(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=2, rounds=2, federation="e", codec="int8:channel"),
                               ("127.0.0.1", 1))  # fmt: skip
    override_toml(layout.server_config, strategy={"name": "fedavg"})
    return layout


def test_a_bad_codec_in_server_toml_is_refused_naming_the_key(federation):
    override_toml(federation.server_config, server={"codec": "int4"})
    with pytest.raises(ConfigError, match="server.codec: unknown codec 'int4'; choose fp32, fp16, int8"):
        load_server_config(federation.server_config)


def _update(engine: RoundEngine, agent: str, text: str, seed: int) -> tuple[Completed, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    floats = float_part(engine.global_arrays)
    change = {k: (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in floats.items()}
    codec = Codec.parse(text)
    meta = UpdateMeta(round=engine.round_state.round, base_version=engine.version, samples=100, loss=0.3, codec=text)
    data = dumps(encode(change, codec), metadata=meta.to_metadata())
    manifest = Manifest("e", "update", engine.round_state.round, agent, "server", bytes(16), 0.0, len(data), 1 << 20,
                        1, NO_DIGEST)  # fmt: skip
    return Completed(manifest, memoryview(data), len(data)), decode(encode(change, codec), codec, engine.float_spec)


def test_the_server_refuses_another_codec_and_aggregates_the_decoded_deltas(federation):
    engine = RoundEngine(load_server_config(federation.server_config), replay=ReplayGuard(3600))
    assert engine.codec == Codec.parse("int8:channel")
    engine.begin_round(["agent-01", "agent-02"], now=0.0)
    engine.announce(now=0.0)
    before = {k: v.copy() for k, v in float_part(engine.global_arrays).items()}
    with pytest.raises(UpdateRejected, match="wrong-codec: encoded as fp32, the round asks for int8:channel"):
        engine.accept(_update(engine, "agent-01", "fp32", seed=1)[0])
    first, sent_1 = _update(engine, "agent-01", "int8:channel", seed=1)
    second, sent_2 = _update(engine, "agent-02", "int8:channel", seed=2)
    assert engine.accept(first).wire_bytes * 3.9 < len(_update(engine, "agent-01", "fp32", seed=1)[0].data)
    engine.accept(second)
    metrics = engine.close(now=1.0, model_wire_bytes=0)
    assert metrics.accepted == ["agent-01", "agent-02"] and metrics.outcome == "committed"
    for name, start in before.items():
        np.testing.assert_allclose(engine.global_arrays[name], start + (sent_1[name] + sent_2[name]) / 2, atol=1e-6)


def test_transfer_limits_leave_room_for_the_largest_encoding(federation):
    override_toml(federation.server_config, server={"codec": "topk:1.0"})  # indices and values: twice fp32
    engine = RoundEngine(load_server_config(federation.server_config), replay=ReplayGuard(3600))
    engine.begin_round(["agent-01", "agent-02"], now=0.0)
    encoded = _update(engine, "agent-01", "topk:1.0", seed=1)[0].data
    fp32 = _update(engine, "agent-01", "fp32", seed=1)[0].data
    assert largest_update_bytes(engine.float_spec, engine.codec) > len(encoded) > 1.9 * len(fp32)
