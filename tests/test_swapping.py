"""Server-mediated model swapping over a real mosquitto, with real agents and real training (docs/results/swapping.md).

One federation of four agents runs ``fedswap`` with h1 = 1, h2 = 3 (swap, swap, average) while a raw
subscriber records every inbox message, and the server is killed with ``kill -9`` after the first swap,
while the agents train on their partners' models. Checked: each agent's second round starts from
exactly (bit for bit) the model its partner held after the first; an inbox message opens only for its
recipient; nothing is lost across the kill (every round complete, the final average published).
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from security.envelope import Opener
from security.keys import Identity, Keyring, PublicIdentity
from tests.fedharness import Federation, override_toml, wait_until
from tests.liveharness import (
    Recording,
    SlowInRound,
    Sniffer,
    assert_each_opens_only_for_its_owner,
    float_windows,
    identical,
    leaks,
    record_local_models,
    record_slot,
    start_server_process,
)


@pytest.mark.timeout(300)
def test_swap_hands_each_agent_its_partners_model_sealed_to_it_and_survives_kill_9(tmp_path, broker):
    fed = Federation(tmp_path, broker, rounds=3, agents=4, partition="dirichlet:0.5")
    override_toml(fed.layout.server_config, strategy={"name": "fedswap", "h1": 1, "h2": 3}, rounds={"quorum": 4})
    locals_by_agent = {}
    for agent in fed.agents:
        agent.runner.trainer = SlowInRound(Recording(agent.runner.trainer), round_number=2, delay_s=6.0)
        locals_by_agent[agent.id] = record_local_models(agent)
    sniffer = Sniffer(broker)
    log = tmp_path / "server.log"
    server = start_server_process(fed.layout.server_config, log)
    fed.start_agents()
    state_file = fed.server_state / "checkpoint" / "state.json"

    def in_round_2() -> bool:
        try:
            rs = json.loads(state_file.read_text())["round_state"]
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        return bool(rs) and rs["round"] == 2 and not rs["updates"]

    try:
        wait_until(in_round_2, 120, "round 2 open after the first swap")
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        server = start_server_process(fed.layout.server_config, log)
        assert server.wait(180) == 0, log.read_text()[-3000:]
    finally:
        _stop(server, sniffer, fed)

    metrics = fed.metrics()
    assert [(m.round, m.action) for m in metrics] == [(1, "swap"), (2, "swap"), (3, "average")]
    assert all(sorted(m.accepted) == sorted(m.participants) and len(m.accepted) == 4 for m in metrics)
    assert [m.model_version for m in metrics] == [1, 1, 2]  # only the average publishes a new global model
    assert "server resumed" in log.read_text()

    pairs = metrics[0].aggregation["pairs"]
    assert sorted(a for pair in pairs for a in pair) == sorted(a.id for a in fed.agents)
    trainers = {a.id: a.runner.trainer.inner for a in fed.agents}
    for a, b in pairs:  # after the swap each trained on exactly its partner's model of round 1
        assert identical(trainers[a].bases[2], locals_by_agent[b][0])
        assert identical(trainers[b].bases[2], locals_by_agent[a][0])
        assert not identical(trainers[a].bases[2], trainers[b].bases[2])

    identities = {a.id: Identity.load(a.config.identity_path) for a in fed.agents}
    server_public = PublicIdentity.load(fed.agents[0].config.server_key_path)
    inbox = [(t.split("/")[3], p) for t, p in sniffer.payloads if t.endswith("/inbox") and p]
    starts = [(owner, p) for owner, p in inbox if b"start" in p[:200]]
    assert {owner for owner, _ in starts} == set(identities)
    assert_each_opens_only_for_its_owner(starts, identities, server_public)
    windows = set().union(*(float_windows(locals_by_agent[a][0]) for a in identities))
    assert not any(leaks(p, windows) for _, p in starts)


@pytest.mark.timeout(300)
def test_local_rounds_upload_nothing_and_the_next_upload_carries_their_training(tmp_path, broker):
    """fedswap with h1 = 2, h2 = 2 over the real daemons: local, swap, local, average. A raw subscriber opens
    every update chunk with the server's key: chunks arrive for rounds 2 and 4 only. The local rounds'
    metrics say ``bytes_up`` 0 and list every agent as having trained; each upload round's update is the
    change from the model the server named, through the local round's training (each agent's round-2 start
    is its round-1 result, bit for bit)."""
    fed = Federation(tmp_path, broker, rounds=4, agents=4, partition="dirichlet:0.5")
    override_toml(fed.layout.server_config, strategy={"name": "fedswap", "h1": 2, "h2": 2}, rounds={"quorum": 4})
    results = {}
    for agent in fed.agents:
        agent.runner.trainer = Recording(agent.runner.trainer)
        results[agent.id] = record_slot(agent, "continued")
    sniffer = Sniffer(broker)
    log = tmp_path / "server.log"
    server = start_server_process(fed.layout.server_config, log)
    fed.start_agents()
    try:
        assert server.wait(180) == 0, log.read_text()[-3000:]
    finally:
        _stop(server, sniffer, fed)

    metrics = fed.metrics()
    assert [(m.round, m.action) for m in metrics] == [(1, "local"), (2, "swap"), (3, "local"), (4, "average")]
    assert all(len(m.accepted) == 4 for m in metrics)
    assert [m.bytes_up for m in metrics][::2] == [0, 0] and all(m.bytes_up > 0 for m in metrics[1::2])
    assert metrics[0].eval == {} and metrics[-1].model_version == 2
    server_identity = Identity.load(fed.layout.server_config.parent / "server.key")
    agents = Keyring([PublicIdentity.load(p) for p in (fed.layout.server_config.parent / "enrolled").glob("*.pub")])
    opener = Opener(identity=server_identity, federation="it", senders=agents)
    rounds = [opener.open_chunk(p).manifest.round for t, p in sniffer.payloads if t.endswith("/update") and p]
    assert set(rounds) == {2, 4}
    trainers = {a.id: a.runner.trainer for a in fed.agents}
    for agent, kept in results.items():  # round 2 trained on from the local round's model, and so did round 4
        assert identical(trainers[agent].bases[2], kept[0]) and identical(trainers[agent].bases[4], kept[1])


def _stop(server, sniffer: Sniffer, fed: Federation) -> None:  # noqa: ANN001
    if server.poll() is None:
        server.kill()
    sniffer.close()
    fed.close()


