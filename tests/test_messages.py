"""JSON message schemas: round trips, versioning, and refusal of malformed input."""

import dataclasses
import json

import pytest

from protocol.messages import AgentStatus, MessageError, Rejection, RoundMetrics, RoundTask, TrainSettings
from protocol.topics import Topics
from protocol.typed import SchemaError, build
from tests.fedharness import round_metrics, round_task


def _task(**overrides):
    fields = dict(federation="f", round=3, model_version=3, selected=["a", "b"], pending=["b"], deadline=10.0)
    return round_task(**{**fields, "issued_at": 5.0, "train": TrainSettings(epochs=2), **overrides})


def test_round_task_round_trips_with_nested_settings():
    task = _task()
    assert RoundTask.from_json(task.to_json()) == task


def test_reader_ignores_unknown_fields_but_refuses_another_major_version():
    data = json.loads(_task().to_json())
    data["future_field"] = 1
    assert RoundTask.from_dict(data).round == 3
    data["schema"] = "skyfed.round/1.3"
    assert RoundTask.from_dict(data).round == 3
    data["schema"] = "skyfed.round/2"
    with pytest.raises(MessageError, match="unsupported version"):
        RoundTask.from_dict(data)


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"not json", "not JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"schema":"skyfed.agent-status/1","agent":"a"}', "missing"),
        (b'{"schema":"skyfed.metrics/1","round":true}', "round has the wrong type"),
        (b"x" * 300_000, "exceed the limit"),
    ],
)
def test_malformed_messages_are_refused_with_a_reason(payload, reason):
    cls = RoundMetrics if b"metrics" in payload else AgentStatus
    with pytest.raises(MessageError, match=reason):
        cls.from_json(payload)


def test_non_finite_numbers_are_sent_as_null_and_never_received():
    m = round_metrics(eval={"accuracy": 0.5, "loss": float("inf")}, aggregate_s=float("nan"))
    assert json.loads(m.to_json())["eval"] == {"accuracy": 0.5, "loss": None}  # encoding never raises
    for literal in (b"NaN", b"Infinity", b"1e999", b"1" + b"0" * 400):  # the last an integer past float's range
        with pytest.raises(MessageError):
            AgentStatus.from_json(
                b'{"schema":"skyfed.agent-status/1","agent":"a","state":"x","round":1,'
                b'"samples":1,"version":1,"updated_at":' + literal + b"}"
            )
    with pytest.raises(MessageError):
        AgentStatus.from_json(
            b'{"schema":"skyfed.agent-status/1","agent":"a","state":"x","round":1,'
            b'"samples":1,"version":1,"updated_at":NaN}'
        )


def test_hostile_json_is_a_message_error_not_a_crash():
    for payload in (b"[" * 100_000, b'{"a":' * 50_000, b"1" * 5000, b"\xff\xfe"):
        with pytest.raises(MessageError):
            AgentStatus.from_json(payload)


def test_metrics_carry_rejections_as_objects():
    m = round_metrics(accepted=[], rejected=[Rejection("a", "bad-chunk")])
    assert json.loads(m.to_json())["rejected"] == [{"agent": "a", "reason": "bad-chunk"}]
    assert RoundMetrics.from_json(m.to_json()) == m


def test_topics_are_built_and_parsed_and_bad_names_refused():
    t = Topics("fleet-1")
    assert t.agent_update("drone.7") == "skyfed/fleet-1/agent/drone.7/update"
    assert t.agent_of("skyfed/fleet-1/agent/drone.7/status") == "drone.7"
    assert t.agent_of("skyfed/other/agent/drone.7/status") is None
    assert t.model_version_of(t.model_chunk(12, 3)) == 12
    for bad in ("a/b", "+", "#", "", "x" * 65):
        with pytest.raises(ValueError, match="federation"):
            Topics(bad)


@pytest.mark.parametrize(
    "key, bad, where", [("selected", ["a", 7], "selected[1]"), ("pending", ["b", None], "pending[1]")]
)
def test_a_list_of_names_is_checked_item_by_item_when_one_is_not_a_string(key, bad, where):
    """Lists of exact strings (or ints) pass as they are, a round task's thousand agent names in one check;
    anything else is converted item by item, and a wrong item still names its index."""
    data = json.loads(_task().to_json())
    assert RoundTask.from_dict(data).selected == ["a", "b"]
    data[key] = bad
    with pytest.raises(MessageError, match=rf"{where.replace('[', '[[]')} has the wrong type"):
        RoundTask.from_dict(data)


def test_a_bool_is_not_an_int_in_a_list_and_ints_in_a_float_list_become_floats():
    @dataclasses.dataclass
    class Lists:
        counts: list[int]
        weights: tuple[float, ...] = ()

    assert build(Lists, {"counts": [1, 2], "weights": [1, 2.5]}, where="t", strict=True) == Lists([1, 2], (1.0, 2.5))
    assert type(build(Lists, {"counts": [1], "weights": [1]}, where="t", strict=True).weights[0]) is float
    with pytest.raises(SchemaError, match=r"t.counts\[1\] has the wrong type"):
        build(Lists, {"counts": [1, True]}, where="t", strict=True)
