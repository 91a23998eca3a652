"""The round engine with a model-keeping strategy, without a broker: per-agent starts, validation
against each agent's own base, the kept models' arithmetic, pruning, and a restart between rounds."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from broker_server.config import load_server_config
from broker_server.rounds.engine import RoundEngine
from flcore.agent_models import Assignment, Holding, ModelWriter, Peers, settle
from flcore.bounds import InfluencePolicy
from flcore.strategies import build_strategy
from flcore.strategies.base import KeptModels
from flcore.update import UpdateRejected
from models.weights import TensorSpec, advanced, fingerprint, float_part
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml
from tests.fixtures import AGENTS, run_round, update


@pytest.fixture
def config(tmp_path):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=3, federation="e"), ("127.0.0.1", 1))
    override_toml(
        layout.server_config,
        rounds={"min_agents": 3, "quorum": 3},
        strategy={"name": "fedswap", "h1": 1, "h2": 2},  # swap, average, swap
        bounds={"clip": "off"},
    )
    return load_server_config(layout.server_config)


def test_swap_round_keeps_models_pairs_them_and_the_next_round_checks_each_agents_own_base(config):
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    sent = run_round(engine, seed=0)
    first = engine.close(now=1.0, model_wire_bytes=1000)
    assert first.action == "swap" and first.model_version == 1 and engine.version == 1
    assert first.bytes_down == 3000  # everyone downloaded the global model, nobody got an inbox model
    models = {a: advanced(base, delta) for a, (base, delta) in sent.items()}  # what each agent holds now
    (a, b), = first.aggregation["pairs"]  # fmt: skip
    alone = (set(AGENTS) - {a, b}).pop()  # odd agent: goes on from its own model
    assert engine.assignments[a] == Assignment("inbox", Holding(1, b, fingerprint(models[b])))
    assert engine.assignments[b] == Assignment("inbox", Holding(1, a, fingerprint(models[a])))
    assert engine.assignments[alone] == Assignment("local", Holding(1, alone, fingerprint(models[alone])))
    for agent in AGENTS:
        start = engine.start_model(agent)
        owner = engine.assignments[agent].model.owner
        assert all(np.array_equal(start[k], models[owner][k]) for k in start)

    resumed = RoundEngine(config, replay=ReplayGuard(3600))  # a restart between the swap and round 2
    assert resumed.assignments == engine.assignments
    resumed.begin_round(AGENTS, now=2.0)
    resumed.announce(now=2.0)
    assert resumed.round_state.action == "average"
    wrong, _ = update(resumed, a, seed=9, base_sha256="")  # trained from the global model, not its partner's
    with pytest.raises(UpdateRejected, match="wrong-base"):
        resumed.accept(wrong)
    deltas = {}
    for i, agent in enumerate(AGENTS):
        done, deltas[agent] = update(resumed, agent, seed=10 + i, samples=100 * (i + 1))
        resumed.accept(done)
    second = resumed.close(now=3.0, model_wire_bytes=1000)
    assert second.action == "average" and second.outcome == "committed" and resumed.version == 2
    weights = {agent: min(100 * (i + 1), 200) for i, agent in enumerate(AGENTS)}  # among three: at most the median
    owner = {agent: engine.assignments[agent].model.owner for agent in AGENTS}
    for name, value in float_part(resumed.global_arrays).items():
        expected = sum(
            weights[x] * (models[owner[x]][name].astype(np.float64) + deltas[x][name]) for x in AGENTS
        ) / sum(weights.values())
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6, err_msg=name)
    assert resumed.assignments == {}  # after an average everyone starts from the global model
    bank = config.state_dir / "checkpoint" / "agents"  # kept models no one needs: released, written over next
    assert [p.name for p in bank.iterdir()] == [".spare"]


def test_fedswap_plans_starts_by_action_and_settle_keeps_the_rest():
    """The strategy hook (``plan_starts``) decides each agent's start; ``settle`` adds the engine's part:
    agents asked whose update did not count get the server's copy of their model, the others keep theirs."""
    kept = {x: Holding(4, x, x * 2) for x in "abc"}
    current = {"d": Assignment("local", Holding(2, "d", "dd")), "e": Assignment("local", Holding(3, "e", "ee"))}
    asked = [*"abc", "e"]  # e was asked to train but its update did not count (refused, late or excused)
    spec = (TensorSpec("w", "float32", (2,)),)

    def keeps_nothing(owner: str) -> ModelWriter:
        raise AssertionError(f"FedSwap kept a new model, {owner}")

    def models(action: str, exact: set[str]) -> KeptModels:
        return KeptModels(round=4, action=action, agents=list("abc"), kept=kept, exact=exact, current=current,
                          spec=spec, vector=lambda h: np.full(2, ord(h.owner), np.float32),
                          writer=keeps_nothing, peers=lambda models: Peers(models, "p"),
                          rng=lambda: np.random.default_rng(7))  # fmt: skip

    strategy = build_strategy({"name": "fedswap"})
    average = strategy.plan_starts(models("average", set("abc")))
    assert average.publish and settle(current, asked, kept, average.starts) == {}
    local_plan = strategy.plan_starts(models("local", {"a", "b"}))
    local = settle(current, asked, kept, local_plan.starts)
    assert not local_plan.publish and local["a"].source == "local"
    assert local["c"] == Assignment("inbox", kept["c"])  # c was clipped: the server's copy differs from its own
    assert local["d"] == current["d"]  # not asked: unchanged
    assert local["e"] == Assignment("inbox", current["e"].model)  # it may have overwritten its own copy
    swap_plan = strategy.plan_starts(models("swap", set("abc")))
    ((a, b),) = swap_plan.detail["pairs"]  # 3 agents: one pair, one left over
    swap = settle(current, asked, kept, swap_plan.starts)
    assert swap[a] == Assignment("inbox", kept[b]) and swap[b] == Assignment("inbox", kept[a])
    (left,) = set("abc") - {a, b}
    assert swap[left] == Assignment("local", kept[left])  # unpaired
    rolled_back = settle(current, ["d"], {}, {})
    assert rolled_back["d"] == Assignment("inbox", current["d"].model) and rolled_back["e"] == current["e"]


def test_a_drifting_agent_is_pulled_back_before_its_model_is_swapped_or_averaged(config):
    """The clip bounds each step; the kept model's distance from the global one is bounded too (here the
    per-round clip is a fixed bound too large to bite, so only the drift bound acts)."""
    config = dataclasses.replace(config, bounds=InfluencePolicy(clip="fixed", clip_norm=1e9, clip_multiple=2.0))
    engine = RoundEngine(config, replay=ReplayGuard(3600))
    engine.begin_round(AGENTS, now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(AGENTS):
        done, _ = update(engine, agent, seed=i, scale=10.0 if agent == "agent-03" else 1.0)
        engine.accept(done)
    detail = engine.close(now=1.0, model_wire_bytes=0).aggregation
    assert detail["drift_capped"] == ["agent-03"]
    held = next(a.model for a in engine.assignments.values() if a.model.owner == "agent-03")
    drift = np.linalg.norm(engine.state.store.agents.vector(held).astype(np.float64) - engine.global_vector)
    assert drift == pytest.approx(detail["drift_bound"], rel=1e-4)
    assert "agent-03" not in [a for a, x in engine.assignments.items() if x.source == "local"]  # not its own copy


def test_assignments_are_written_when_a_round_changes_them_not_at_every_update_and_old_checkpoints_load(config):
    checkpoint = config.state_dir / "checkpoint"

    def written() -> list[str]:
        return sorted(p.name for p in checkpoint.glob("assignments-*.json"))

    engine = RoundEngine(config, replay=ReplayGuard(3600))
    run_round(engine, seed=0)
    engine.close(now=1.0, model_wire_bytes=1000)  # the swap: every agent assigned
    after_swap = written()
    assert len(after_swap) == 1 and len(json.loads((checkpoint / after_swap[0]).read_text())) == len(AGENTS)
    engine.begin_round(AGENTS, now=2.0)
    engine.announce(now=2.0)
    for i, agent in enumerate(AGENTS):
        done, _ = update(engine, agent, seed=10 + i)
        engine.accept(done)
        assert written() == after_swap  # the same file at each accepted update
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["assignments_file"] == after_swap[0] and "assignments" not in state
    state["assignments"] = json.loads((checkpoint / after_swap[0]).read_text())  # as a checkpoint from before held them
    del state["assignments_file"]
    (checkpoint / "state.json").write_text(json.dumps(state))
    assert RoundEngine(config, replay=ReplayGuard(3600)).assignments == engine.assignments
    engine.close(now=3.0, model_wire_bytes=1000)  # the average: nobody assigned, the swap's table deleted
    assert len(written()) == 1 and written() != after_swap
    assert json.loads((checkpoint / written()[0]).read_text()) == {}
