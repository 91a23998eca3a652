"""Peer mode (SmartFed DFL, agent.peer) over a real broker: real keys, sealing, PyTorch training (digits, a
tiny CNN, one or two rounds). Peers run as the real daemon on threads of the test's process with their
trainer in-process (as sim.agent_host hosts them), except the one a test kills, which is its own process."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agent.config import load_agent_config
from agent.peer.bestagg import BEST_FILE
from agent.peer.election import Election
from agent.peer.rounds import read_metrics
from common import toml
from flcore.update import TrainResult
from models.serialization import load_file
from models.weights import NamedArrays, fingerprint, float_part
from models.zoo import initial_model
from participant.trainer import PeerContext, Trainer, TrainerWrapper
from protocol.config import ConfigError, write_toml
from protocol.messages import RoundTask
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.peer_messages import Adoption, PeerBest, PeerMember
from protocol.topics import Topics
from security.keys import Identity, PublicIdentity, revoke
from security.signing import signed_payload, verify_document
from sim.attacks import Attack, AttackingTrainer
from sim.federation import SimSettings
from sim.plot_peers import ElectedModel, draw_peer_curves
from sim.report import write_report
from sim.report_rows import read_rows
from sim.run import run_sim
from tests.fedharness import override_toml, wait_until
from tests.liveharness import SlowInRound, peer_configs, state

ROOT = Path(__file__).resolve().parent.parent


class Recording(TrainerWrapper):
    """Remembers every round's start model and result (what a centralized FedAvg of the same updates needs)."""

    def __init__(self, inner: Trainer) -> None:
        super().__init__(inner)
        self.rounds: dict[int, tuple[NamedArrays, TrainResult]] = {}

    def train(self, global_arrays: NamedArrays, task: RoundTask, context: PeerContext | None = None) -> TrainResult:
        result = self.inner.train(global_arrays, task, context)
        self.rounds[task.round] = ({k: v.copy() for k, v in global_arrays.items()}, result)
        return result


def published_decisions(broker, configs: dict[str, Path]) -> dict[str, Adoption]:  # noqa: ANN001
    """Each peer's election decision as the broker retains it (its ``best``), its signature checked."""
    reader = MqttClient("test-reader", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
    reader.subscribe(Topics("sim").peer_wildcard("best"))
    assert reader.start(timeout_s=10)
    decisions: dict[str, Adoption] = {}

    def read() -> bool:
        while (message := reader.poll(0.1)) is not None:
            name = message[0].split("/")[-2]
            public = PublicIdentity.load(configs[name].parent / "enrolled" / f"{name}.pub")
            best = PeerBest.from_dict(verify_document(json.loads(message[1]), public))
            if best.adopted.sha256:
                decisions[name] = best.adopted
        return set(decisions) == set(configs)

    try:
        wait_until(read, 10, "every peer's decision retained")
    finally:
        reader.stop()
    return decisions


def test_three_peers_waiting_for_all_end_with_centralized_fedavg_of_their_updates(tmp_path, broker, peers):
    configs = peer_configs(tmp_path, broker, rounds=2, strategy={"name": "fedavg"})
    recorders = {}
    for name, path in configs.items():
        peers.start(path, wrap=lambda inner, name=name: recorders.setdefault(name, Recording(inner)))
    peers.wait_done(list(configs))
    models = {name: load_file(state(path) / BEST_FILE)[0] for name, path in configs.items()}
    first = next(iter(models.values()))
    for model in models.values():  # every peer aggregated the same updates in the same order: the same bits
        assert all(np.array_equal(model[k], first[k]) for k in first)
    reference = float_part(initial_model("digits_cnn", 10, 0))
    for round_number in (1, 2):
        starts = [recorders[n].rounds[round_number][0] for n in configs]
        for start in starts:  # every peer started the round from the model a centralized FedAvg would have sent
            for name, value in reference.items():
                np.testing.assert_allclose(start[name], value, rtol=0, atol=2e-5)
        results = [recorders[n].rounds[round_number][1] for n in configs]
        total = sum(r.samples for r in results)
        reference = {name: (value.astype(np.float64) + sum(
            r.samples / total * (r.arrays[name].astype(np.float64) - value) for r in results)).astype(np.float32)
            for name, value in reference.items()}  # fmt: skip
    for name, value in reference.items():
        np.testing.assert_allclose(first[name], value, rtol=0, atol=2e-5)
    for name, path in configs.items():
        lines = read_metrics(state(path))
        assert [(line["round"], line["aggregated_from"]) for line in lines] == [(1, list(configs)), (2, list(configs))]
        assert all(line["peer"] == name and "accuracy" in line["eval"] for line in lines)
        trained = lines[-1]["personal"]["trained"]  # each sender's own C-SPE of the model it trained, as it reported
        each = [a["c_spe"] for a in trained["agents"].values()]
        assert sorted(trained["agents"]) == list(configs) and all(0 <= c <= 1 for c in each)
        assert trained["c_spe"] == pytest.approx(np.mean(each), abs=1e-6)
    decisions = published_decisions(broker, configs)  # made public, signed and retained, as election.json says
    for name, path in configs.items():
        election = json.loads((state(path) / "election.json").read_text())
        adopted = decisions[name]
        assert (adopted.sha256, adopted.owner) == (fingerprint(models[name]), election["adopted_from"])
        assert adopted.score == election["score"] and 0.0 <= adopted.score <= 1.0


def test_a_revoked_peer_is_dropped_and_its_models_refused(tmp_path, broker, peers, caplog):
    configs = peer_configs(tmp_path, broker)
    honest = ["agent-01", "agent-02"]
    for name in honest:
        revoke(configs[name].parent / "enrolled", "agent-03")  # skyfed provision revoke does this in every folder
    caplog.set_level(logging.INFO)
    for path in configs.values():
        peers.start(path)
    peers.wait_done(honest)
    for name in honest:
        assert [line["aggregated_from"] for line in read_metrics(state(configs[name]))] == [honest]
        assert "agent-03" not in peers.nodes[name].members()
    refusals = caplog.text
    assert "membership refused peer=agent-03 reason=revoked" in refusals
    assert "transfer refused peer=agent-03 reason=revoked" in refusals


def test_a_membership_forged_by_a_non_member_is_refused(tmp_path, broker, peers, caplog):
    configs = peer_configs(tmp_path, broker, join_wait_s=60.0)  # it only gathers memberships here
    caplog.set_level(logging.INFO)
    node = peers.start(configs["agent-01"])
    wait_until(lambda: node.edge.mqtt.connected.is_set(), what="the peer to connect")
    topics = Topics("sim")
    mallory = Identity.generate("mallory")  # not enrolled: its own key
    client = MqttClient("mallory", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
    assert client.start(timeout_s=10)
    try:
        for peer in ("mallory", "agent-02"):  # its own membership, and one in an enrolled peer's name
            forged = PeerMember("sim", peer, "member", 1, 1.0, 1.0)
            client.publish(topics.peer_member(peer), signed_payload(forged.to_dict(), mallory), retain=True)
        wait_until(lambda: "peer=agent-02 reason=unknown-signer" in caplog.text, what="the forged membership refused")
    finally:
        client.stop()
    assert "membership refused peer=mallory reason=not-enrolled" in caplog.text
    assert node.members() == ["agent-01"]  # neither counts: only itself


def nan_trainer(inner: Trainer) -> Trainer:
    class NaN(TrainerWrapper):
        def train(self, global_arrays, task, context=None):  # noqa: ANN001, ANN202
            honest = self.inner.train(global_arrays, task, context)
            return replace(honest, arrays={k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v
                                           for k, v in honest.arrays.items()})  # fmt: skip

    return NaN(inner)


def test_hostile_peers_are_bounded_refused_and_cannot_win_the_election(tmp_path, broker, peers):
    # 20 s: a peer that finishes its last round more than the timeout after another is not waited for in the
    # election (SmartFed's timeout). The honest peers wait the 20 s for a fourth valid update that never comes;
    # the liar keeps its own plan (threshold 3), so its claim is in well before their elections close, whatever
    # the load (waiting 20 s too, it claimed at about the moment an honest peer's election timed out)
    configs = peer_configs(tmp_path, broker, agents=4, bounds={"clip": "adaptive"}, round_timeout_s=20.0)
    override_toml(configs["agent-03"], federation={"threshold": 3})
    honest = ["agent-01", "agent-02"]
    for name in honest:
        peers.start(configs[name])
    peers.start(configs["agent-03"], wrap=lambda inner: AttackingTrainer(inner, Attack("scale", 100.0), "agent-03"))
    peers.start(configs["agent-04"], wrap=nan_trainer)
    peers.nodes["agent-04"].work._accept = lambda *_: True  # a rogue peer skips its own checks and sends anyway
    liar = peers.nodes["agent-03"].work.bestagg
    honest_elect = liar.start

    def lying_elect(model: NamedArrays, round_number: int, evaluation: dict[str, float], now: float) -> None:
        noise = {k: np.random.default_rng(0).normal(0, 1, v.shape).astype(v.dtype) if v.dtype.kind == "f" else v
                 for k, v in model.items()}  # fmt: skip
        honest_elect(noise, round_number, {"accuracy": 1.0}, now)  # claims a perfect score for a model of noise

    liar.start = lying_elect
    peers.wait_done(honest)
    elections = []
    for name in honest:
        (line,) = read_metrics(state(configs[name]))
        assert line["aggregated_from"] == ["agent-01", "agent-02", "agent-03"]
        assert {"peer": "agent-04", "reason": "non-finite-values: NaN or Inf in the delta"} in line["rejected"]
        assert line["aggregation"]["clipped"] == ["agent-03"]  # the scaled update moved the model no further
        elections.append(json.loads((state(configs[name]) / "election.json").read_text()))
        # its model of noise is refused as it comes (a negative running variance), not waited for
        assert elections[-1]["refused"].startswith("agent-03: invalid-running-var: "), elections
    # the liar refused, the next best claim leads: both adopt the same peer's model (on main each kept its own)
    # one model for every honest peer, never a rogue's; peers holding that same model may each name themselves
    assert len({e["sha256"] for e in elections}) == 1, elections
    assert not {e["adopted_from"] for e in elections} & {"agent-03", "agent-04"}, elections


def test_a_peer_killed_mid_round_does_not_stop_the_others(tmp_path, broker, peers):
    configs = peer_configs(tmp_path, broker, rounds=3, round_timeout_s=120.0)
    victim = configs["agent-03"]  # its own process, killed while it trains round 2 (30x slower than the others)
    process = subprocess.Popen([sys.executable, "-m", "sim.agent_host", "--config", str(victim), "--slow",
                                str(victim), "--slowdown", "30"], cwd=ROOT, stdout=open(tmp_path / "victim.log", "wb"),
                               stderr=subprocess.STDOUT)  # fmt: skip
    try:
        for name in ("agent-01", "agent-02"):
            peers.start(configs[name])
        wait_until(lambda: read_metrics(state(victim)), 90, "the victim to finish round 1")
        process.kill()  # no clean stop: the broker publishes its signed last will ("left")
        process.wait(10)
        peers.wait_done(["agent-01", "agent-02"], timeout_s=60)  # well before the 120 s round timeout
    finally:
        process.kill()
    for name in ("agent-01", "agent-02"):
        lines = read_metrics(state(configs[name]))
        assert [line["aggregated_from"] for line in lines] == [list(configs), ["agent-01", "agent-02"],
                                                               ["agent-01", "agent-02"]]  # fmt: skip
        assert "agent-03" not in lines[-1]["members"]


def test_bad_peer_plans_fail_at_start_naming_the_key(tmp_path, broker):
    configs = peer_configs(tmp_path, broker)
    path = configs["agent-01"]
    for plan, key in (({"threshold": 0}, "federation.threshold"), ({"rounds": 0}, "federation.rounds"),
                      ({"strategy": {"name": "fedswap"}}, "federation.strategy.name"),
                      ({"strategy": {"name": "trimmed-mean", "beta": 0.7}}, "strategy.beta"),
                      ({"bounds": {"clip": "sometimes"}}, "bounds.clip"),
                      ({"mode": "mesh"}, "federation.mode")):  # fmt: skip
        override_toml(path, federation=plan)
        with pytest.raises(ConfigError, match=key):
            load_agent_config(path)
        override_toml(path, federation={"threshold": 3, "rounds": 1, "strategy": {}, "bounds": {}, "mode": "peer"})
    override_toml(path, keys={"server": "agent-01.key"})
    with pytest.raises(ConfigError, match="keys.enrolled"):
        load_agent_config(path)
    override_toml(path, federation={"mode": "client"})  # the plan keys left in: a client gets its plan from the server
    with pytest.raises(ConfigError, match='round plan keys are for mode = "peer"'):
        load_agent_config(path)


def test_peers_default_to_the_servers_measured_strategy_and_refuse_what_needs_a_server_saying_why(tmp_path, broker):
    path = peer_configs(tmp_path, broker)["agent-01"]
    assert load_agent_config(path).federation.build_strategy().name == "auto"  # on main: fedavg
    for table, why in (({"name": "fedprox", "partial_work": True}, "strategy.partial_work sets each agent's share"),
                       ({"name": "fedadam"}, "it steps a server optimizer"),
                       ({"name": "fedamn"}, "it keeps every agent's model on a server")):  # fmt: skip
        override_toml(path, federation={"strategy": table})
        with pytest.raises(ConfigError, match=f"strategy.name '{table['name']}' does not work between peers: {why}"):
            load_agent_config(path)
    override_toml(path, federation={"strategy": {"name": "fedprox", "partial_work": False}})  # its recipe travels
    assert load_agent_config(path).federation.build_strategy().name == "fedprox"


@pytest.mark.parametrize(("mode", "tables", "named"), [
    ("peer", {"agent": {"status_interval_s": 2.0}}, "agent.status_interval_s"),
    ("peer", {"training": {"onnx": True}}, "training.onnx"),
    ("client", {"keys": {"enrolled": "enrolled"}}, "keys.enrolled"),
])  # fmt: skip
def test_a_key_the_role_never_reads_is_refused_at_start_naming_it(tmp_path, broker, mode, tables, named):
    path = peer_configs(tmp_path, broker)["agent-01"]
    if mode == "client":
        data = toml.loads(path.read_text())
        data.pop("federation")
        data["keys"] = {"identity": "agent-01.key", "server": "enrolled/agent-02.pub"}
        write_toml(path, data)
        load_agent_config(path)
    override_toml(path, **tables)
    with pytest.raises(ConfigError, match=f'{named} is not used with federation.mode = "{mode}": .*; remove it'):
        load_agent_config(path)


def test_a_late_joiner_starts_from_the_median_of_the_members_models(tmp_path, broker, peers, caplog):
    configs = peer_configs(tmp_path, broker, rounds=4, threshold=2)
    caplog.set_level(logging.INFO)
    for name in ("agent-01", "agent-02"):
        peers.start(configs[name], wrap=lambda inner: SlowInRound(inner, None, 2.0))  # rounds outlast its join
    wait_until(lambda: read_metrics(state(configs["agent-01"])), 60, "round 1 of the first two")
    late = peers.start(configs["agent-03"])
    peers.wait_done(list(configs))
    assert "caught up from=agent-01,agent-02" in caplog.text
    lines = read_metrics(state(configs["agent-03"]))
    assert lines and lines[0]["round"] >= 2 and lines[-1]["round"] == 4
    assert late.work.done


def test_skyfed_sim_mode_peer_writes_a_line_per_round_and_peer_and_the_elected_model(tmp_path, broker):
    settings = SimSettings(mode="peer", agents=2, rounds=2, partition="iid", epochs=1, deadline_s=30)
    result = run_sim(settings, tmp_path / "out", broker_address=broker.address, echo=lambda line: None)
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["round"], line["peer"]) for line in lines] == [(1, "agent-01"), (1, "agent-02"), (2, "agent-01"),
                                                                 (2, "agent-02")]  # fmt: skip
    assert all(line["aggregated_from"] == ["agent-01", "agent-02"] and "accuracy" in line["eval"] for line in lines)
    assert set(load_file(tmp_path / "out" / "global_model.safetensors")[0]) == set(initial_model("digits_cnn", 10, 0))
    assert result.final_eval["accuracy"] > 0.5  # the elected model on the centralized sim's evaluation set
    out = tmp_path / "out"  # skyfed report: a curve per peer, both holding the elected model
    assert write_report(out, echo=lambda line: None) == [out / "curves.png", out / "agents.png"]
    score = draw_peer_curves(read_rows(out / "metrics.jsonl"), ElectedModel.read(out / "election.json", [])).axes[0]
    assert sorted(line.get_label() for line in score.lines) == ["agent-01 (adopted it)", "agent-02 (adopted it)",
                                                               "elected model"]  # fmt: skip


def test_the_example_peer_config_is_valid_apart_from_its_paths(tmp_path, broker):
    path = peer_configs(tmp_path, broker)["agent-01"].parent / "example.toml"
    example = toml.loads((ROOT / "deploy" / "examples" / "peer.toml").read_text())
    del example["broker"]["tls"]  # its certificates are a provisioned peer's; here the test broker is plain MQTT
    write_toml(path, example)
    override_toml(path, agent={"id": "agent-01", "data": "data.npz", "test_data": "test.npz", "state_dir": "state"},
                  keys={"identity": "agent-01.key", "enrolled": "enrolled"})  # fmt: skip
    config = load_agent_config(path)
    assert config.peer_mode and config.federation.threshold == 4 and config.federation.build_strategy().name == "auto"


def test_a_best_model_claim_left_retained_by_an_earlier_run_does_not_count():
    own = PeerBest("sim", "agent-01", 2, 0.9, "a" * 64, session=5.0)
    election = Election("agent-01", own, margin=0.05, started=0.0)
    election.note(PeerBest("sim", "agent-02", 2, 1.0, "b" * 64, session=1.0))  # agent-02's claim of its last run
    sessions = {"agent-01": 5.0, "agent-02": 7.0}  # agent-02 is a member again, in a new connection
    assert not election.complete(sessions) and election.leader(sessions).peer == "agent-01"
    election.note(PeerBest("sim", "agent-02", 2, 0.8, "c" * 64, session=7.0))
    assert election.complete(sessions) and election.leader(sessions).peer == "agent-01"
