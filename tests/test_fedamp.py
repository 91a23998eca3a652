"""FedAMP (the strongest baseline of seed 003) on the start-model hook: its attention weights by hand for
three agents, the engine sealing each agent its own cloud model (as its start, or beside its own model in the
paper's form), and the proximal pull toward the model sent beside the start."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from broker_server.config import load_server_config
from broker_server.rounds.engine import RoundEngine
from flcore.strategies import build_strategy
from flcore.strategies.fedamp import FedAMPOptions, attention_weights
from models.datasets import load_digits
from models.weights import advanced, fingerprint, flatten, float_part, to_arrays, with_floats
from models.zoo import build_model
from participant.classifier import ClassifierTrainer
from participant.declined import TrainingDeclined
from participant.recipes import checked
from participant.trainer import PeerContext
from protocol.messages import RecipeRecord, TrainSettings
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml, round_task
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
                  strategy={"name": "fedamp", "sigma": 10.0, "lam": 0.5, "start": "cloud"})  # fmt: skip
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
    for agent in AGENTS:  # each named by its fingerprint, which its agent checks the model it receives against
        assert engine.assignments[agent].model.sha256 == fingerprint(engine.start_model(agent))
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
    override_toml(fed.layout.server_config, rounds={"quorum": 3},
                  strategy={"name": "fedamp", "sigma": 50.0, "start": "cloud"})  # fmt: skip
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


def test_in_the_papers_form_each_agent_goes_on_from_its_own_model_with_its_cloud_model_beside_it(tmp_path):
    """``start = "own"``, the default (PFLlib's clientamp): the start is the agent's own wᵢ, and uᵢ comes as a
    one-model bundle that the proximal recipe pulls toward."""
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=2, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 3, "quorum": 3}, bounds={"clip": "off"},
                  strategy={"name": "fedamp", "sigma": 10.0, "lam": 0.5})  # fmt: skip
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    proximal = {"name": "proximal", "options": {"mu": 0.5, "toward": "peer"}, "version": 1}
    assert list(engine.round_state.train["recipes"]) == [proximal]
    held = {}
    for i, agent in enumerate(AGENTS):
        done, delta = update(engine, agent, seed=i)
        held[agent] = advanced(engine.start_model(agent), delta)
        engine.accept(done)
    assert engine.close(now=1.0, model_wire_bytes=1000).outcome == "committed"
    vectors = np.array([flatten(float_part(held[a]), engine.float_spec) for a in AGENTS], np.float64)
    xi = attention_weights(vectors @ vectors.T, FedAMPOptions(sigma=10.0, lam=0.5))
    for i, agent in enumerate(AGENTS):
        assignment = engine.assignments[agent]
        assert assignment.source == "local" and assignment.model.owner == agent  # wᵢ, which it holds: no download
        np.testing.assert_array_equal(engine.base_vector(agent), vectors[i].astype(np.float32))
        assert [h.owner for h in assignment.peers.models] == [f"+cloud-{agent}"]
        bundle = engine.peer_bundle(agent)
        cloud = flatten({name: stack[0] for name, stack in bundle.items()}, engine.float_spec)
        np.testing.assert_allclose(cloud, xi[i] @ vectors, rtol=2.0**-15, atol=1e-6)  # dithered within 2^-16
        assert not np.allclose(cloud, vectors[i], atol=1e-4)  # the others count
        # uᵢ leaves the server only dithered in the bundle: it is named at random, not hashed (ModelBank.writer)
        (holding,) = assignment.peers.models
        exact = with_floats(engine.global_arrays, engine.state.store.agents.vector(holding), engine.float_spec)
        assert re.fullmatch("[0-9a-f]{64}", holding.sha256) and holding.sha256 != fingerprint(exact)
        assert not holding.fingerprinted and assignment.model.fingerprinted
    with pytest.raises(ValueError, match="strategy.start 'mine' must be one of own, cloud"):
        build_strategy({"name": "fedamp", "start": "mine"})


def test_the_pull_toward_the_model_sent_beside_the_start_is_that_model_not_the_start(tmp_path):
    """One full-batch SGD step without momentum from wᵢ: toward uᵢ it lands lr·μ·(uᵢ − wᵢ) away from where the
    pull toward the start (no pull at the first step) lands; with no model beside the start it pulls toward it."""
    train, _ = load_digits(test_fraction=0.8, seed=0)
    own = to_arrays(build_model("mlp_digits"))
    cloud = {name: array + np.float32(0.01) * (1 + np.arange(array.size, dtype=np.float32).reshape(array.shape))
             / array.size for name, array in own.items()}  # fmt: skip
    beside = PeerContext({name: array[None] for name, array in cloud.items()}, own)
    lr, mu = 0.1, 2.0
    trained = {}
    for toward, context in (("peer", beside), ("start", beside), ("peer", None)):
        trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path / toward)
        settings = TrainSettings(epochs=1, batch_size=len(train.y), lr=lr, momentum=0.0,
                                 recipes=(RecipeRecord("proximal", {"mu": mu, "toward": toward}),))  # fmt: skip
        task = round_task(model="mlp_digits", run_id="r", strategy="fedamp", train=settings)
        trained[toward, context is not None] = trainer.train(own, task, context).arrays
    for name in own:
        pulled = trained["peer", True][name] - trained["start", True][name]
        np.testing.assert_allclose(pulled, lr * mu * (cloud[name] - own[name]), atol=1e-6)
        np.testing.assert_array_equal(trained["peer", False][name], trained["start", True][name])
    with pytest.raises(ValueError, match="toward must be one of start, peer, got 'cloud'"):
        checked(RecipeRecord("proximal", {"mu": 0.1, "toward": "cloud"}))
    two = PeerContext({name: np.stack([array, array]) for name, array in cloud.items()}, own)
    with pytest.raises(TrainingDeclined, match="exactly one model sent beside the start"):
        trainer.train(own, task, two)


@pytest.mark.timeout(300)
def test_over_a_real_broker_each_agent_trains_on_from_its_own_model_with_its_cloud_model_beside_it(tmp_path, broker):
    """The paper's form through the daemons: round 2 starts from each agent's own model, with one model beside it."""
    from broker_server.daemon import Aggregator
    from tests.fedharness import Federation
    from tests.liveharness import Recording

    fed = Federation(tmp_path, broker, rounds=2, agents=3, partition="shards")
    override_toml(fed.layout.server_config, rounds={"quorum": 3}, strategy={"name": "fedamp", "sigma": 50.0})
    for agent in fed.agents:
        agent.runner.trainer = Recording(agent.runner.trainer)
    server = Aggregator(load_server_config(fed.layout.server_config))
    fed.run(server, timeout_s=180)
    assert [len(m.accepted) for m in fed.metrics()] == [3, 3]
    for agent in fed.agents:
        recorded = agent.runner.trainer
        assert recorded.contexts[1] is None  # round 1: everyone from the global model, pulled toward it
        assert {len(stack) for stack in recorded.contexts[2].peers.values()} == {1}  # uᵢ beside the start
    assert len({fingerprint(a.runner.trainer.bases[2]) for a in fed.agents}) == 3  # three own start models


def test_each_model_is_kept_as_its_update_is_accepted_and_a_clipped_one_again_at_the_close(tmp_path):
    """The close's keep step (``broker_server.rounds.keep_step``) runs as each update is accepted: the agent's
    model is on disk before the round closes, and the close takes it as it is (bit for bit the agent's own
    model). An update the round's clip shrinks is kept again at the close, from its clipped step."""
    agents = [*AGENTS, "agent-04"]
    layout = create_federation(tmp_path, SimSettings(agents=4, rounds=2, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 4, "quorum": 4},
                  strategy={"name": "fedamp", "sigma": 10.0, "lam": 0.5})  # fmt: skip
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    engine.begin_round(agents, now=0.0)
    engine.announce(now=0.0)
    held, folder, start = {}, engine.state.store.agents.directory / "r1", engine.global_vector.copy()
    for i, agent in enumerate(agents):
        done, delta = update(engine, agent, seed=i, scale=30.0 if agent == "agent-04" else 1.0)
        held[agent] = flatten(float_part(advanced(engine.start_model(agent), delta)), engine.float_spec)
        engine.accept(done)
        assert (folder / f"{agent}.safetensors").exists()  # kept before the round closes
    metrics = engine.close(now=1.0, model_wire_bytes=1000)
    assert metrics.outcome == "committed"
    for agent in AGENTS:
        np.testing.assert_array_equal(engine.base_vector(agent), held[agent])
    kept_step = np.linalg.norm(engine.base_vector("agent-04") - start)
    assert kept_step < 0.5 * np.linalg.norm(held["agent-04"] - start)  # not the whole update kept on acceptance
