"""FedAMP (the strongest baseline of seed 003) on the start-model hook: its attention weights by hand for
three agents, and the engine sealing each agent its own cloud model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from broker_server.config import load_server_config
from broker_server.rounds.engine import RoundEngine
from flcore.strategies import build_strategy
from flcore.strategies.fedamp import FedAMPOptions, attention_weights
from models.weights import advanced, fingerprint, flatten, float_part
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml
from tests.fixtures import update

AGENTS = ["agent-01", "agent-02", "agent-03"]


def test_distance_attention_for_three_agents_by_hand():
    models = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])  # squared distances 1, 4 and 5
    xi = attention_weights(models @ models.T, FedAMPOptions(alpha_k=1.0, sigma=2.0))
    e = lambda d2: math.exp(-d2 / 2.0) / 2.0  # noqa: E731 - αₖ·A'(x) with σ = 2
    np.testing.assert_allclose(xi[0], [1 - e(1) - e(4), e(1), e(4)])
    np.testing.assert_allclose(xi[2], [e(4), e(5), 1 - e(4) - e(5)])
    np.testing.assert_allclose(xi.sum(axis=1), 1.0)
    close = attention_weights(np.zeros((3, 3)), FedAMPOptions(alpha_k=1.0, sigma=0.5))  # others' weights 2 each
    # scaled so the agent's own model keeps self_weight (0.5): the first version gave it 0, the others all
    np.testing.assert_allclose(close, [[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]])


def test_cosine_attention_keeps_its_self_weight_and_prefers_the_aligned_model():
    models = np.array([[1.0, 0.0], [1.0, 0.1], [-1.0, 0.0]])
    xi = attention_weights(models @ models.T, FedAMPOptions(attention="cosine", sigma=5.0, self_weight=0.3))
    np.testing.assert_allclose(np.diag(xi), 0.3)
    np.testing.assert_allclose(xi.sum(axis=1), 1.0)
    assert xi[0, 1] > 50 * xi[0, 2]  # agent 1 points where agent 0 does; agent 2 the other way


def test_each_agent_gets_its_own_cloud_model_sealed_to_it(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=2, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3}, bounds={"clip": "off"},
                  strategy={"name": "fedamp", "sigma": 10.0, "lam": 0.5})  # fmt: skip
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    proximal = {"name": "proximal", "options": {"mu": 0.5}, "version": 1}
    assert list(engine.round_state.train["recipes"]) == [proximal]  # λ/αₖ toward the cloud model
    held = {}
    for i, agent in enumerate(AGENTS):
        done, delta = update(engine, agent, seed=i)
        held[agent] = advanced(engine.start_model(agent), delta)
        engine.accept(done)
    metrics = engine.close(now=1.0, model_wire_bytes=1000)
    assert metrics.outcome == "committed" and engine.version == 2
    vectors = np.array([flatten(float_part(held[a]), engine.float_spec) for a in AGENTS], np.float64)
    xi = attention_weights(vectors @ vectors.T, FedAMPOptions(sigma=10.0, lam=0.5))
    assert 0.5 < xi[0, 0] < 0.99  # the others count: d² ≈ 7.7 against σ = 10
    for i, agent in enumerate(AGENTS):
        assignment = engine.assignments[agent]
        assert assignment.source == "inbox" and assignment.model.owner == f"+cloud-{agent}"
        np.testing.assert_allclose(engine.base_vector(agent), xi[i] @ vectors, rtol=1e-5, atol=1e-6)
        assert metrics.aggregation["self_weight"][agent] == pytest.approx(xi[i, i], abs=1e-6)
    assert len({engine.assignments[a].model.sha256 for a in AGENTS}) == 3  # three personal models
    with pytest.raises(ValueError, match="strategy.attention 'dot' must be one of distance, cosine"):
        build_strategy({"name": "fedamp", "attention": "dot"})


@pytest.mark.timeout(300)
def test_over_a_real_broker_each_cloud_model_opens_only_for_its_agent(tmp_path, broker):
    """A hostile enrolled agent reads every inbox on the broker: it can open none of the others' cloud models,
    and each agent trains round 2 from a model of its own (the agent checks the task's SHA-256 of it)."""
    from broker_server.daemon import Aggregator
    from security.keys import Identity, PublicIdentity
    from tests.fedharness import Federation
    from tests.liveharness import Recording, Sniffer, assert_each_opens_only_for_its_owner

    fed = Federation(tmp_path, broker, rounds=2, agents=3, partition="shards")
    override_toml(fed.layout.server_config, rounds={"quorum": 3}, strategy={"name": "fedamp", "sigma": 50.0})
    for agent in fed.agents:
        agent.runner.trainer = Recording(agent.runner.trainer)
    sniffer = Sniffer(broker)
    server = Aggregator(load_server_config(fed.layout.server_config))
    try:
        fed.run(server, timeout_s=180)
    finally:
        sniffer.close()
    assert [len(m.accepted) for m in fed.metrics()] == [3, 3]
    assignments = server.engine.assignments  # after round 2; round 2's starts are gone, so check the sha256s
    assert {a.model.owner for a in assignments.values()} == {f"+cloud-{a.id}" for a in fed.agents}
    identities = {a.id: Identity.load(a.config.identity_path) for a in fed.agents}
    server_public = PublicIdentity.load(fed.agents[0].config.server_key_path)
    starts = [(t.split("/")[3], p) for t, p in sniffer.payloads if t.endswith("/inbox") and p and b"start" in p[:200]]
    assert {owner for owner, _ in starts} == set(identities)  # everyone got its own cloud model for round 2
    assert_each_opens_only_for_its_owner(starts, identities, server_public)
    bases = [a.runner.trainer.bases[2] for a in fed.agents]
    assert len({fingerprint(b) for b in bases}) == 3  # three personal start models
