"""Property tests for every parser that sees network bytes: only its documented error may escape, and
memory stays bounded by the input.

Inputs are random bytes, random JSON, and valid messages with random mutations (flips, truncations,
insertions, field values swapped for arbitrary JSON), which reach deeper than random bytes do.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flcore.update import UpdateMeta, UpdateMetaError, UpdateRejected, parse_update
from models.serialization import SerializationError, dumps, float32_region, loads
from models.weights import spec_of
from protocol.messages import AgentStatus, MessageError, RoundMetrics, RoundTask, ServerStatus
from protocol.transfer import PAGE, Reassembler, TransferLimits, TransferRejected
from security.envelope import InvalidEnvelope, Manifest, Opener, seal
from security.keys import GroupKey, Identity, Keyring
from security.signing import InvalidDocument, sign_document, verify_document
from tests.fedharness import round_metrics, round_task
from tests.fixtures import bounded, mutated

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SERVER, AGENT = Identity.generate("server"), Identity.generate("agent")
GROUP = GroupKey.generate()
UPDATE_CHUNKS = seal(
    bytes(range(256)) * 40,
    sender=AGENT,
    federation="f",
    kind="update",
    round=1,
    recipient=SERVER.public,
    chunk_size=4096,
)[1]
MODEL_CHUNKS = seal(
    bytes(5000), sender=SERVER, federation="f", kind="model", round=2, group_key=GROUP, chunk_size=1024
)[1]
ARRAYS = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.float32)}
META = UpdateMeta(round=1, base_version=1, samples=10, loss=0.5).to_metadata()
SAFETENSORS = dumps(ARRAYS, metadata=META)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


def opener(**kwargs) -> Opener:
    return Opener(identity=SERVER, federation="f", senders=Keyring([AGENT.public, SERVER.public]), **kwargs)


@FUZZ
@given(st.binary(max_size=600) | mutated([c[8:300] for c in UPDATE_CHUNKS[:1] + MODEL_CHUNKS[:1]]))
def test_manifest_parser_raises_only_invalid_envelope(data):
    bounded(Manifest.from_bytes, data, (InvalidEnvelope,))


@FUZZ
@given(st.binary(max_size=2000) | mutated(UPDATE_CHUNKS + MODEL_CHUNKS))
def test_chunk_opener_raises_only_invalid_envelope(payload):
    bounded(opener(group_keys={GROUP.key_id: GROUP}).open_chunk, payload, (InvalidEnvelope,))


@FUZZ
@given(st.lists(st.sampled_from(UPDATE_CHUNKS) | mutated(UPDATE_CHUNKS) | st.binary(max_size=64), max_size=30))
def test_reassembler_raises_only_transfer_rejected_and_holds_at_most_its_quota(payloads):
    limits = TransferLimits(
        max_bytes=64 << 10, max_partial_per_sender=2, max_pending_bytes_per_sender=8 * PAGE, max_pending_bytes=12 * PAGE
    )
    reassembler = Reassembler(opener(), limits)
    for payload in payloads:
        try:
            done = reassembler.feed(payload, topic_sender="agent", kinds=frozenset({"update"}))
        except TransferRejected:
            continue
        assert done is None or bytes(done.data) == bytes(range(256)) * 40
        assert reassembler.pending_bytes() <= 8 * PAGE


VALID_JSON = {
    AgentStatus: AgentStatus(agent="a", state="idle", round=1, samples=1, version=1, updated_at=1.0),
    ServerStatus: ServerStatus.offline("f"),
    RoundMetrics: round_metrics(),
    RoundTask: round_task(),
}


@FUZZ
@given(
    st.sampled_from(list(VALID_JSON)),
    st.binary(max_size=3000) | st.builds(lambda v: json.dumps(v).encode(), json_values),
)
def test_json_messages_raise_only_message_error_on_any_bytes(cls, payload):
    bounded(cls.from_json, payload, (MessageError,))


@FUZZ
@given(st.sampled_from(list(VALID_JSON)), st.data())
def test_json_messages_raise_only_message_error_when_fields_hold_anything(cls, data):
    body = json.loads(VALID_JSON[cls].to_json())
    for key in data.draw(st.lists(st.sampled_from(sorted(body)), max_size=4)):
        body[key] = data.draw(json_values)
    bounded(cls.from_json, json.dumps(body).encode(), (MessageError,))


@FUZZ
@given(json_values, st.data())
def test_signed_documents_raise_only_invalid_document(value, data):
    document = sign_document(VALID_JSON[RoundTask].to_dict(), SERVER)
    if data.draw(st.booleans()):
        document = value
    else:
        document[data.draw(st.sampled_from(["body", "signer", "sig"]))] = value
    try:
        verify_document(document, SERVER.public)
    except InvalidDocument:
        pass


headers = st.dictionaries(
    st.text(max_size=8),
    st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "F16", "I64", "BOOL", "X9"]) | json_values,
            "shape": st.lists(st.integers(-2, 2**40), max_size=4) | json_values,
            "data_offsets": st.lists(st.integers(-5, 2**40), max_size=3) | json_values,
        }
    )
    | json_values,
    max_size=4,
)


@FUZZ
@given(headers, st.binary(max_size=256))
def test_safetensors_reader_raises_only_serialization_error_on_hostile_headers(header, body):
    raw = json.dumps(header).encode()
    payload = len(raw).to_bytes(8, "little") + raw + body
    bounded(loads, payload, (SerializationError,))
    bounded(float32_region, payload, (SerializationError,))


@FUZZ
@given(st.binary(max_size=1000) | mutated([SAFETENSORS]))
def test_update_validation_raises_only_update_rejected(payload):
    spec = spec_of({k: v for k, v in sorted(ARRAYS.items())})
    bounded(lambda p: parse_update(p, expected_spec=spec, round_number=1, model_version=1), payload, (UpdateRejected,))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(META) + ["x"]), st.text(max_size=30), max_size=7))
def test_update_header_raises_only_update_meta_error(metadata):
    try:
        UpdateMeta.from_metadata({**META, **metadata})
    except UpdateMetaError:
        pass


@pytest.mark.parametrize("digits", [5000, 100_000])
def test_huge_integers_in_json_are_refused_not_crashing(digits):
    with pytest.raises(MessageError):
        AgentStatus.from_json(b'{"schema":"skyfed.agent-status/1","round":' + b"9" * digits + b"}")
