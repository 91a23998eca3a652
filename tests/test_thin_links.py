"""Update codecs through the real daemons over a broker: the agents encode with the round's codec, keep
top-k's residual on disk, and the server decodes, checks and averages; the bytes shrink as promised."""

from __future__ import annotations

import pytest

from models.serialization import load_file
from tests.fedharness import Federation
from tests.fixtures import FP32_UPDATE_BYTES


@pytest.mark.parametrize(("codec", "at_most"), [("int8:channel", 1 / 3.8), ("topk:0.02", 1 / 20)])
def test_a_federation_trains_with_encoded_updates_and_sends_fewer_bytes(tmp_path, broker, codec, at_most):
    fed = Federation(tmp_path, broker, rounds=2, agents=2, strategy={"name": "fedavg"}, codec=codec)
    _, server_thread = fed.start_with_server()
    try:
        server_thread.join(120)
        assert not server_thread.is_alive(), "the federation did not finish"
    finally:
        fed.close()
    metrics = fed.metrics()
    assert [m.round for m in metrics] == [1, 2] and all(sorted(m.accepted) == ["agent-01", "agent-02"] for m in metrics)
    assert all(m.rejected == [] for m in metrics)
    per_update = metrics[-1].bytes_up / 2
    assert per_update < FP32_UPDATE_BYTES * at_most * 1.1  # sealing and chunk headers on top of the payload
    residual = fed.agents[0].config.state_dir / "residual.safetensors"
    if codec.startswith("topk"):  # what top-k did not send waits on the agent, across restarts
        arrays, _ = load_file(residual)
        assert sum(float(abs(a).sum()) for a in arrays.values()) > 0
    else:
        assert not residual.exists()  # int8 keeps no residual
