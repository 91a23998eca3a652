"""FedAMN (seed 003) on the start-model hook, the server's half: k-means within the traffic limit, the
progressive switch, each agent's bundle of its cluster mates' models, a restart that keeps them, sybils that
cannot isolate everyone, the downlink counted in process, and over a real broker each bundle sealed to its
agent alone and the attention trained from it."""

from __future__ import annotations

import itertools
import json
import re
import time

import numpy as np
import pytest

from broker_server.config import load_server_config
from broker_server.rounds.engine import RoundEngine
from flcore.agent_models import BUNDLE_NAME, DITHER, bundle_name
from flcore.strategies import build_strategy
from flcore.strategies.fedamn import clusters_within, principal_coordinates
from models.serialization import dumps, loads
from models.weights import advanced, fingerprint, flatten, float_part
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml
from tests.fixtures import update
from tests.liveharness import identical

AGENTS = [f"agent-{i:02d}" for i in range(1, 6)]


def test_principal_coordinates_keep_the_distances_and_clusters_fit_the_limit():
    rng = np.random.default_rng(3)
    centers = 10 * rng.standard_normal((3, 40))
    models = np.concatenate([c + rng.standard_normal((4, 40)) for c in centers])  # three blobs of four
    centered = models - models.mean(axis=0)
    points = principal_coordinates(centered @ centered.T)
    distances = np.linalg.norm(models[:, None] - models[None], axis=2)
    np.testing.assert_allclose(np.linalg.norm(points[:, None] - points[None], axis=2), distances, atol=1e-8)
    labels = clusters_within(points, 4, np.random.default_rng(0))
    assert sorted(sorted(np.flatnonzero(labels == k)) for k in np.unique(labels)) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # fmt: skip
    assert (clusters_within(points, 12, np.random.default_rng(0)) == 0).all()  # k = 1: no partition
    assert np.bincount(clusters_within(points, 3, np.random.default_rng(0))).max() <= 3
    assert sorted(clusters_within(points, 1, np.random.default_rng(0))) == list(range(12))


def test_fedavg_until_round_p_then_each_agent_gets_its_cluster_and_a_restart_keeps_them(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=5, rounds=3, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 5, "quorum": 5}, bounds={"clip": "off"},
                  strategy={"name": "fedamn", "after": 3, "max_peers": 2, "meta_epochs": 2})  # fmt: skip
    config = load_server_config(layout.server_config)
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    largest = max(engine.float_spec, key=lambda s: np.prod(s.shape)).name
    for round_number in (1, 2):
        engine.begin_round(AGENTS, now=0.0)
        engine.announce(now=0.0)
        attention = {"name": "attention", "options": {"epochs": 2, "lr": 0.01}, "version": 1}
        assert list(engine.round_state.train["recipes"]) == [attention]
        held = {}
        for i, agent in enumerate(AGENTS):
            done, delta = update(engine, agent, seed=10 * round_number + i, samples=100 * (i + 1),
                                 fill={largest: 0.05 if i % 2 else -0.05})  # two kinds of agents  # fmt: skip
            held[agent] = advanced(engine.start_model(agent), delta)
            engine.accept(done)
        metrics = engine.close(now=1.0, model_wire_bytes=1000)
        assert metrics.outcome == "committed"
    assert round_number == 2 and "clusters" in metrics.aggregation  # round 3 = p: the plan after round 2
    vectors = {a: flatten(float_part(m), engine.float_spec) for a, m in held.items()}
    weights = np.arange(1, 6, dtype=float)
    expected = sum(w * vectors[a] for w, a in zip(weights, AGENTS, strict=True)) / weights.sum()  # FedAvg of the models
    np.testing.assert_allclose(engine.global_vector, expected, rtol=1e-5, atol=1e-6)
    clusters = metrics.aggregation["clusters"]
    assert sorted(a for c in clusters for a in c) == AGENTS and max(map(len, clusters)) <= 3
    assert clusters == [["agent-01", "agent-03", "agent-05"], ["agent-02", "agent-04"]]  # by their kind
    assert metrics.bytes_down == 5 * 1000  # round 2: everyone downloaded the global model alone
    for cluster in clusters:
        for agent in cluster:
            assignment = engine.assignments[agent]
            assert assignment.source == "local" and assignment.model.owner == agent  # its own model
            bundle = engine.peer_bundle(agent)
            peers = assignment.peers
            assert bundle_name(peers.models, peers.salt, engine.float_spec) == peers.sha256  # no bundle hashed
            rows = [flatten({k: bundle[k][r] for k in bundle}, engine.float_spec) for r in range(len(cluster) - 1)]
            owners = [next(a for a in AGENTS if np.allclose(row, vectors[a], rtol=1.01 * DITHER, atol=0))
                      for row in rows]  # fmt: skip
            assert sorted(owners) == [a for a in cluster if a != agent]  # its cluster mates' models, dithered
            assert not any(np.array_equal(vectors[a], row) for a, row in zip(owners, rows, strict=True))

    resumed = RoundEngine(config, replay=ReplayGuard(3600))  # a server restart keeps every bundle
    assert resumed.assignments == engine.assignments
    assert all(identical(resumed.peer_bundle(a), engine.peer_bundle(a)) for a in AGENTS)  # same rows, same dither
    resumed.begin_round(AGENTS, now=2.0)
    resumed.announce(now=2.0)
    assert all(resumed.needs_global(a) for a in AGENTS)  # the meta-network attends over the global model too


def public_names(payload: bytes) -> set[bytes]:
    """Every fingerprint-like string (64 hex digits) in a payload others may read."""
    return set(re.findall(rb"[0-9a-f]{64}", payload))


def row_names(bundle: dict[str, np.ndarray], base: dict[str, np.ndarray]) -> set[bytes]:
    """What a bundle holder can compute from each row: its fingerprint as a whole model (the rest from ``base``)
    and as float tensors alone."""
    names = set()
    for r in range(next(iter(bundle.values())).shape[0]):
        floats = {k: v[r] for k, v in bundle.items()}
        names |= {fingerprint(floats).encode(), fingerprint(base | floats).encode()}
    return names


def test_no_bundle_row_can_be_named_from_the_round_task(tmp_path):
    """The round task lists each agent beside its start model's fingerprint; on the tip a bundle row was that
    model bit for bit, so any holder named every row (and rows went in an order drawn from server.seed and the
    round). Now no row's fingerprint is in the task, each recipient's rows go in an order of their own, and the
    rows are still the mates' models (to a factor within DITHER)."""
    from broker_server.agents.publisher import PublishedModel
    from broker_server.rounds.round_task import round_task

    layout = create_federation(tmp_path, SimSettings(agents=5, rounds=3, federation="e"), ("127.0.0.1", 1))
    override_toml(layout.server_config, rounds={"min_agents": 5, "quorum": 5},
                  strategy={"name": "fedamn", "after": 1, "max_peers": 4})  # fmt: skip
    engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    for round_number in (1, 2):
        engine.begin_round(AGENTS, now=0.0)
        engine.announce(now=0.0)
        held = {}
        for i, agent in enumerate(AGENTS):
            done, delta = update(engine, agent, seed=10 * round_number + i)
            held[agent] = advanced(engine.start_model(agent), delta)
            engine.accept(done)
        assert engine.close(now=1.0, model_wire_bytes=1000).outcome == "committed"
    engine.begin_round(AGENTS, now=2.0)
    engine.announce(now=2.0)
    published = PublishedModel(engine.version, fingerprint(engine.global_arrays), 1, 1000)
    task = round_task(engine, published, federation="e", group_key_id="k", now=2.0)
    public = public_names(task.to_json())
    assert {fingerprint(m).encode() for m in held.values()} <= public  # the task names every agent's start model
    orders = []
    for agent in AGENTS:
        bundle, peers = engine.peer_bundle(agent), engine.assignments[agent].peers
        assert task.start_of(agent).peers_sha256 == peers.sha256
        assert not row_names(bundle, engine.global_arrays) & public
        rows = [{k: v[r] for k, v in bundle.items()} for r in range(len(AGENTS) - 1)]
        owners = [next(a for a in AGENTS if all(np.allclose(row[k], held[a][k], rtol=1.01 * DITHER, atol=0)
                                                for k in row)) for row in rows]  # fmt: skip
        assert sorted(owners) == [a for a in AGENTS if a != agent]
        orders.append(owners)
    # on the tip every bundle followed one shuffle of the cluster; now no order of the agents fits them all (the
    # chance that 5 independent shuffles fit one is under 120 / 24^5 = 1.5e-5)
    assert not any(all([a for a in order if a in owners] == owners for owners in orders)
                   for order in itertools.permutations(AGENTS))  # fmt: skip


def test_bad_options_name_the_key_and_a_run_shorter_than_p_is_a_problem():
    with pytest.raises(ValueError, match="strategy.max_peers must be >= 1"):
        build_strategy({"name": "fedamn", "max_peers": 0})
    with pytest.raises(ValueError, match="strategy.meta_lr must be > 0"):
        build_strategy({"name": "fedamn", "meta_lr": 0})
    strategy = build_strategy({"name": "fedamn", "after": 10})
    assert "never joins and the run is plain FedAvg; set strategy.after to 5 or less" in strategy.run_problem(5)
    assert strategy.run_problem(10) == strategy.run_problem(0) == ""  # p is run; 0: forever


def test_a_fedamn_run_that_ends_before_p_is_refused_at_start_by_the_server_and_the_sim(tmp_path):
    """It ran plain FedAvg, the only word in the server's log (``skyfed sim --strategy fedamn --rounds 5``)."""
    from broker_server.config import ConfigError

    layout = create_federation(tmp_path, SimSettings(agents=2, rounds=5, federation="p"), ("127.0.0.1", 1))
    override_toml(layout.server_config, strategy={"name": "fedamn"})
    with pytest.raises(ConfigError, match="server.rounds = 5: fedamn runs 5 rounds, all before strategy.after = 10"):
        load_server_config(layout.server_config)
    override_toml(layout.server_config, strategy={"name": "fedamn", "after": 5})
    load_server_config(layout.server_config)
    with pytest.raises(ValueError, match="--rounds 5: fedamn runs 5 rounds.*--strategy-option after=N"):
        SimSettings(agents=2, rounds=5, strategy={"name": "fedamn"})


@pytest.mark.timeout(300)
def test_over_a_real_broker_each_agent_attends_over_its_cluster_sealed_to_it_alone(tmp_path, broker):
    """Round 1 is FedAvg; from round 2 (p) each agent trains from its own model, bit for bit, with its cluster
    mate's model (dithered) and the global model; no fingerprint on a topic others read (tasks, status, models,
    metrics) names a row, and a hostile enrolled agent reading every inbox on the broker can open no bundle but
    its own."""
    from broker_server.daemon import Aggregator
    from security.keys import Identity, PublicIdentity
    from tests.fedharness import Federation
    from tests.liveharness import (
        Recording,
        Sniffer,
        assert_each_opens_only_for_its_owner,
        identical,
        record_local_models,
    )

    fed = Federation(tmp_path, broker, rounds=3, agents=4, partition="shards")
    override_toml(fed.layout.server_config, rounds={"quorum": 4},
                  strategy={"name": "fedamn", "after": 2, "max_peers": 1})  # fmt: skip
    locals_by_agent = {}
    for agent in fed.agents:
        agent.runner.trainer = Recording(agent.runner.trainer)
        locals_by_agent[agent.id] = record_local_models(agent)
    sniffer = Sniffer(broker)
    server = Aggregator(load_server_config(fed.layout.server_config))
    try:
        fed.run(server, timeout_s=200)
    finally:
        sniffer.close()
    metrics = fed.metrics()
    assert [len(m.accepted) for m in metrics] == [4, 4, 4]
    cluster_of = {r: {a: c for c in metrics[r - 2].aggregation["clusters"] for a in c} for r in (2, 3)}  # plans
    assert all(len(c) <= 2 for plans in cluster_of.values() for c in plans.values())  # max_peers + 1
    public = set().union(*(public_names(p) for t, p in sniffer.payloads if not t.endswith(("/inbox", "/update"))))
    assert {fingerprint(m).encode() for models in locals_by_agent.values() for m in models[:2]} <= public
    for agent in fed.agents:
        recorded = agent.runner.trainer
        assert recorded.contexts[1] is None  # FedAvg before p
        for round_number in (2, 3):
            own = locals_by_agent[agent.id][round_number - 2]  # its model after the round before
            assert identical(recorded.bases[round_number], own)
            context, cluster = recorded.contexts[round_number], cluster_of[round_number][agent.id]
            if len(cluster) == 1:  # alone: nobody's model, it trains on from its own
                assert context is None
                continue
            (mate,) = set(cluster) - {agent.id}  # its mate's model after the round before, dithered
            assert all(v.shape[0] == 1 for v in context.peers.values())
            mates = float_part(locals_by_agent[mate][round_number - 2])
            assert context.peers.keys() == mates.keys()
            assert all(np.allclose(v[0], mates[k], rtol=1.01 * DITHER, atol=0) for k, v in context.peers.items())
            assert not row_names(context.peers, own) & public
            assert context.global_model.keys() == context.peers.keys()
    identities = {a.id: Identity.load(a.config.identity_path) for a in fed.agents}
    server_public = PublicIdentity.load(fed.agents[0].config.server_key_path)
    bundles = [(t.split("/")[3], p) for t, p in sniffer.payloads if t.endswith("/inbox") and p and b"peers" in p[:200]]
    paired = {a for plans in cluster_of.values() for a, c in plans.items() if len(c) > 1}
    assert paired and {owner for owner, _ in bundles} == paired
    assert_each_opens_only_for_its_owner(bundles, identities, server_public)
    for agent in fed.agents:  # Θ kept across rounds by the agents that attended
        assert (agent.config.state_dir / "meta_attention.safetensors").exists() == (agent.id in paired)


def test_an_agent_waiting_for_its_start_gets_its_own_model_its_bundle_and_the_global_one(tmp_path, broker, monkeypatch):
    """An asked agent whose status keeps saying ``waiting-model`` lacks one of what the task names: its own model
    (a ``local`` start: its copy lost), its bundle or the global model. The server's resend gives it all three;
    on the branch tip a ``local`` start was never sent again (the agent waited to its deadline, every round)."""
    from broker_server.agents import model_resend
    from protocol.messages import AgentStatus
    from protocol.mqtt import BrokerSettings, MqttClient
    from protocol.transfer import Reassembler
    from security.envelope import Opener
    from security.keys import Keyring
    from security.signing import signed_payload
    from tests.fedharness import ServerHarness, wait_until

    monkeypatch.setattr(model_resend, "MODEL_STALL_S", 0.5)
    with ServerHarness(tmp_path, broker, agents=2, rounds=2, bounds={"clip": "off"},
                       strategy={"name": "fedamn", "after": 1, "max_peers": 1}) as h:  # fmt: skip
        h.announce_agents()
        for i, agent in enumerate(h.agents):
            h.send(agent, h.random_delta(i))
        h.wait_metrics(1)
        task = wait_until(lambda: h.tasks[-1].round == 2 and h.tasks[-1], what="round 2's task")
        start = task.start_of("agent-01")
        assert start.source == "local" and start.peers_sha256
        watcher = MqttClient("watcher", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
        watcher.subscribe(h.topics.agent_inbox("agent-01"))
        assert watcher.start(timeout_s=5)
        opener = Opener(identity=h.agents["agent-01"], federation="t", senders=Keyring([h.server.identity.public]))
        reassembler, received = Reassembler(opener), {}
        try:
            end = time.monotonic() + 3.0
            while time.monotonic() < end and len(received) < 3:
                status = AgentStatus(agent="agent-01", state="waiting-model", round=2, samples=100, version=1,
                                     updated_at=time.time(), group_key_id=h.server.group_keys.key.key_id)  # fmt: skip
                h.driver.publish(h.topics.agent_status("agent-01"), signed_payload(status.to_dict(),
                                                                                    h.agents["agent-01"]), retain=True)
                while (message := watcher.poll(0.2)) is not None:
                    done = reassembler.feed(message[1], topic_sender="server",
                                            kinds=frozenset({"start", "peers", "model"}))  # fmt: skip
                    if done is not None and done.manifest.round == 2:
                        received[done.manifest.kind] = loads(done.data)
        finally:
            watcher.stop()
    assert set(received) == {"start", "peers", "model"}, sorted(received)
    assert fingerprint(received["start"][0]) == start.sha256
    assert received["peers"][1][BUNDLE_NAME] == start.peers_sha256  # the name the task gives it, sealed with it


def test_an_agent_whose_update_did_not_count_keeps_its_bundle_with_its_own_model_on_its_inbox():
    """Refused, late, or the round rolled back: the agent may have replaced its own copy, so its model goes to its
    inbox; its cluster's bundle still stands (the tip dropped it, and the agent trained without attention)."""
    from flcore.agent_models import Assignment, Holding, Peers, settle

    own, mate = Holding(3, "agent-01", "a" * 64), Holding(3, "agent-02", "b" * 64)
    current = {"agent-01": Assignment("local", own, Peers((mate,), "c" * 64))}
    for kept, planned in (({}, {}), ({"agent-02": mate}, {})):  # rolled back; committed without it
        assert settle(current, ["agent-01"], kept, planned) == {"agent-01": Assignment("inbox", own, current[
            "agent-01"].peers)}  # fmt: skip


def test_fedamn_with_a_detector_model_fails_at_start_naming_the_strategy(tmp_path):
    """The detector trainer has no meta-network: its agents would decline every round from p on (the tip
    started such a federation, and its rounds then went without agents)."""
    from broker_server.config import ConfigError

    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="d"), ("127.0.0.1", 1))
    override_toml(layout.server_config, server={"model": "yolov8n", "classes": ["car"]}, strategy={"name": "fedamn"})
    with pytest.raises(ConfigError, match="strategy fedamn needs the attention meta-network"):
        load_server_config(layout.server_config)


def test_a_sim_of_fedamn_with_local_dp_fails_at_start():
    """Every agent would decline from round p on; in process the tip crashed there (TrainingDeclined uncaught)."""
    with pytest.raises(ValueError, match="--strategy fedamn with local DP"):
        SimSettings(agents=2, rounds=2, strategy={"name": "fedamn", "after": 2},
                    local_privacy={"noise_multiplier": 1.0})  # fmt: skip
    SimSettings(agents=2, rounds=2, strategy={"name": "fedamn", "after": 2}, local_privacy={"noise_multiplier": 0.0})


def test_after_a_server_reset_the_new_runs_bundle_is_kept_though_the_old_run_held_a_later_round(tmp_path):
    """A server whose state was reset starts a new run at round 1; the agent's slots still hold the old run's
    round 40. The tip refused every bundle of the new run below round 40 as a replay (stale), so the agent
    waited for its model until its deadline, every round, through round 40; also across an agent restart."""
    from security.envelope import seal
    from security.keys import Identity
    from tests.fedharness import hosted_agent
    from tests.liveharness import signed_task

    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    server = Identity.load(layout.server_config.parent / "server.key")
    agent = hosted_agent(layout.agent_configs["agent-01"])
    old = {"w": np.ones((2, 3), np.float32)}
    agent.client.start_models.keep("peers", old, 40)
    now = time.time()
    agent._on_task(signed_task(server, round=40, issued_at=now))
    agent._on_task(signed_task(server, round=12, run_id="run-b", issued_at=now + 10))  # the server was reset
    assert agent.task.run_id == "run-b"
    bundle = {"w": np.full((2, 3), 2.0, np.float32)}
    _, chunks = seal(dumps(bundle), sender=server, federation="it", kind="peers", round=12,
                     recipient=agent.identity.public)  # fmt: skip
    kinds = frozenset({"peers"})
    assert [agent.inbox.feed(bytes(c), kinds, None, agent.task) for c in chunks][-1] == "peers"
    assert agent.client.start_models.find(fingerprint(bundle)) is not None
    restarted = hosted_agent(layout.agent_configs["agent-01"])
    assert restarted.client.start_models.find(fingerprint(bundle)) is not None
    assert restarted.client.start_models.find(fingerprint(old)) is None  # the old run's bundle is gone


def test_the_round_closed_line_says_how_the_agents_were_clustered(caplog):
    """The operator's journal: how many clusters, the largest, how many agents train alone (the tip said none)."""
    from broker_server.rounds.metrics_log import log_round
    from protocol.messages import RoundMetrics

    m = RoundMetrics(round=4, strategy="fedamn", participants=["a", "b", "c"], accepted=["a", "b", "c"], rejected=[],
                     duration_s=1.0, aggregate_s=0.01, bytes_up=0, bytes_down=0, eval={}, model_version=5,
                     finished_at=0.0, aggregation={"clusters": [["a", "b"], ["c"]]}, action="personal")  # fmt: skip
    with caplog.at_level("INFO", logger="skyfed.server"):
        log_round(m)
    assert caplog.messages[-1].endswith(" clusters=2 largest=2 alone=1")


def test_an_agent_that_declines_says_why_in_its_signed_status(tmp_path):
    """A local-DP agent declines FedAMN's rounds; the operator's ``skyfed monitor`` shows its status detail,
    which the tip left empty (the reason was only in the agent's own journal)."""
    from participant.jobs import Declined, ThreadJob
    from participant.round_client import Training
    from tests.fedharness import hosted_agent
    from tests.fedharness import round_task as a_task

    layout = create_federation(tmp_path, SimSettings(agents=1, rounds=1, federation="it"), ("127.0.0.1", 1))
    agent = hosted_agent(layout.agent_configs["agent-01"])
    agent.task = a_task(selected=["agent-01"], pending=["agent-01"])
    job = ThreadJob("train", lambda: Declined("local DP-SGD does not cover FedAMN's attention meta-network"))
    agent.client.training = Training(agent.task, {}, agent.task.start_of("agent-01"), job, time.perf_counter())
    while job.poll() is None:
        time.sleep(0.01)
    agent._check_training()
    status = agent.report.status()
    assert status.state == "declined" and "FedAMN's attention meta-network" in status.detail


def test_identical_models_cannot_push_every_agent_into_a_cluster_of_its_own():
    """Sybils: twelve enrolled agents send one model; more than a cluster may hold, and k-means cannot split
    them. Before, k climbed until they fitted: 40 clusters of one, nobody attended over anyone."""
    rng = np.random.default_rng(5)
    points = np.concatenate([np.ones((12, 8)), rng.standard_normal((28, 8))])
    labels = clusters_within(points, 11, np.random.default_rng(0))
    sizes = np.bincount(labels)
    assert sizes.max() <= 11 and len(sizes) <= 12  # here 10, of 1-10 agents
    assert len(np.unique(labels[:12])) == 2  # the twelve split in two shares, each within the limit


def test_in_process_fedamn_attends_and_counts_the_models_each_agent_downloads(tmp_path):
    """In process (no broker) the downlink is the models' plaintext: everyone's global model in round 1,
    then from p on the global model and a bundle of its three cluster mates' models each."""
    from models.serialization import dumps
    from models.weights import to_arrays
    from models.zoo import build_model
    from sim.run import run_sim

    settings = SimSettings(agents=4, rounds=2, dataset="mnist1d", model="mnist1d_cnn", partition="shards",
                           in_process=True, epochs=1, strategy={"name": "fedamn", "after": 2})  # fmt: skip
    run_sim(settings, tmp_path / "run", echo=lambda _line: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    model_bytes = len(dumps(to_arrays(build_model("mnist1d_cnn"))))
    assert rows[0]["bytes_down"] == 4 * model_bytes and rows[0]["aggregation"]["clusters"] == [AGENTS[:4]]
    assert rows[1]["bytes_down"] > 4 * model_bytes + 4 * 3 * 0.9 * model_bytes
    assert all(r["outcome"] == "committed" and len(r["accepted"]) == 4 for r in rows)


def test_three_identical_sybils_of_ten_move_the_published_model_no_further_than_the_clip_bound():
    """After rounds of clipped steps in one direction, three sybils' models lie far from w_g (here 100 steps);
    the tip published the plain sample-weighted mean of the models, so they carried w_g 30 steps off in one round.
    Now each model's change from w_g is clipped at the round's clipped step: w_g moves at most one step, and
    the sybils pull by their weight share of it."""
    from flcore.strategies.base import Contribution

    rng = np.random.default_rng(0)
    size, step = 1000, 1.0
    direction = np.ones(size, np.float32) / np.sqrt(size)
    honest = [0.5 * step * rng.standard_normal(size).astype(np.float32) / np.sqrt(size) for _ in range(7)]
    models = honest + [100 * step * direction] * 3  # w_g = 0; every model one clipped step (or less) this round
    strategy = build_strategy({"name": "fedamn", "after": 1})
    strategy.begin(np.zeros(size, np.float32), ())
    steps = [0.5 * step] * 7 + [step] * 3
    contributions = [Contribution(f"agent-{i:02d}", s * direction, 100.0, 1.0, s, model=m)
                     for i, (s, m) in enumerate(zip(steps, models, strict=True))]  # fmt: skip
    result = strategy.aggregate(np.zeros(size, np.float32), contributions)
    moved = result.global_vector
    assert np.linalg.norm(moved) <= step * (1 + 1e-5) and strategy.bounded_by_clip
    assert float(moved @ direction) <= 0.3 * step + 0.7 * 0.5 * step  # their share of a step, not 30 steps
    assert result.detail["models_clipped"] == 3
