"""Regional aggregation: regions as participants of a root, over bridged mosquittos (``[upstream]``,
``region``, ``skyfed sim --regions``)."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from broker_server.config import load_server_config
from broker_server.upstream.handoff import RegionalRoundFailed, RegionResult, RootRound, UpstreamHandoff
from common import toml
from flcore.rounds import UpdateRecord
from models.serialization import load_file
from protocol.config import ConfigError, write_toml
from sim.attacks import Attack, AttackingTrainer
from sim.federation import SimSettings
from sim.regions import create_regions, split_agents
from sim.run import run_sim
from sim.slow import SlowTrainer
from tests.fedharness import override_toml, wait_until
from tests.regionharness import RegionFederation

UNBOUNDED = {"clip": "off", "sample_multiple": 0, "change_multiple": 0, "collapse_ratio": 0, "screen_below": 0}


@pytest.mark.integration  # run_sim starts the brokers and daemons (tests/starters.py cannot see into it)
def test_two_regions_of_three_give_the_flat_fedavg_model(tmp_path: Path) -> None:
    """FedAvg without bounds is associative: the root's average of the regions' weighted averages is the flat
    average of the same six updates, to float32 rounding. Six agents with the same data, seeds and training,
    as six participants of one server and as 2 regions x 3 under a root, over real bridged brokers."""
    common = {"agents": 6, "rounds": 2, "deadline_s": 30.0, "strategy": {"name": "fedavg"}, "bounds": UNBOUNDED,
              "agents_per_process": 3}  # fmt: skip
    flat = run_sim(SimSettings(**common), tmp_path / "flat", echo=lambda _: None)
    regional = run_sim(SimSettings(**common, regions=2), tmp_path / "regions", echo=lambda _: None)
    assert [m.accepted for m in regional.metrics] and all(sorted(m.accepted) == ["region-1", "region-2"]
                                                          for m in regional.metrics)  # fmt: skip
    assert len(regional.metrics) == len(flat.metrics) == 2
    for region in ("region-1", "region-2"):  # each region's own metrics beside the root's
        lines = [json.loads(line) for line in
                 (tmp_path / "regions" / "regions" / region / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
        assert len(lines) == 2
        for own, root in zip(lines, regional.metrics, strict=True):  # its agents' C-SPE, reported up as its own
            reported = root.personal["agents"][region]
            assert reported["c_spe"] == own["personal"]["c_spe"] and 0 < reported["c_spe"] <= 1
            assert root.personal["trained"]["agents"][region]["c_spe"] == own["personal"]["trained"]["c_spe"]
    a = load_file(tmp_path / "flat" / "global_model.safetensors")[0]
    b = load_file(tmp_path / "regions" / "global_model.safetensors")[0]
    assert a.keys() == b.keys()
    worst = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a if a[k].dtype == np.float32)
    assert worst < 1e-5, worst  # float32 rounding of a few additions, far below any training step
    changed = max(float(np.abs(a[k]).max()) for k in a if a[k].dtype == np.float32)
    assert changed > 0.01


def test_a_regions_broker_restarted_mid_round_the_round_still_closes(tmp_path: Path) -> None:
    with RegionFederation(tmp_path, regions=2, agents=4, rounds=2) as fed:
        for name in ("agent-01", "agent-02"):  # region-1's agents: a round long enough to restart under it
            agent = fed.agents[name]
            agent.runner.trainer = SlowTrainer(agent.runner.trainer, 15.0)
        region = fed.regions["region-1"].aggregator
        wait_until(lambda: region.engine.round_state is not None and region.phase == "training", 60,
                   "region-1's first round open")  # fmt: skip
        fed.brokers["region-1"].restart()  # the region's agents, aggregator, participant and bridge all drop
        assert region.engine.round_state is not None and not fed.metrics  # mid-round, at both levels
        rounds = fed.root_rounds(2, timeout_s=150)
        for m in rounds:
            assert m.outcome == "committed" and sorted(m.accepted) == ["region-1", "region-2"], m
        wait_until(lambda: len(fed.region_metrics("region-1")) >= 2, 30, "region-1's second round")
        regional = fed.region_metrics("region-1")
        assert [sorted(m["accepted"]) for m in regional] == [["agent-01", "agent-02"]] * 2
        # every agent trained round 2 from the root's model of round 1: all received the next model
        for name, agent in fed.agents.items():
            assert agent.client.progress.last_completed_round == 2, name


def test_a_hostile_agent_is_bounded_in_its_region_and_a_region_that_lets_it_through_is_bounded_at_the_root(
    tmp_path: Path,
) -> None:
    """agent-04 scales its update 100x in region-2, whose default bounds clip it there; agent-01 does the same
    in region-1, whose operator turned bounds off: region-1's aggregate carries it, and the root clips
    region-1 (three regions: the root's median norm is an honest region's)."""
    with RegionFederation(tmp_path, regions=3, agents=9, rounds=1,
                          region_tables={"region-1": {"bounds": UNBOUNDED}}) as fed:  # fmt: skip
        for name in ("agent-01", "agent-04"):
            agent = fed.agents[name]
            agent.runner.trainer = AttackingTrainer(agent.runner.trainer, Attack.parse("scale:100"), name)
        start = fed.server.engine.global_vector.copy()
        (root_round,) = fed.root_rounds(1, timeout_s=150)
        wait_until(lambda: all(fed.region_metrics(r) for r in fed.regions), 30, "every region's metrics")
        moved = float(np.linalg.norm(fed.server.engine.global_vector - start))
    assert fed.region_metrics("region-2")[0]["aggregation"]["clipped"] == ["agent-04"]
    assert fed.region_metrics("region-1")[0]["aggregation"]["clipped"] == []
    assert root_round.outcome == "committed" and sorted(root_round.accepted) == ["region-1", "region-2", "region-3"]
    assert root_round.aggregation["clipped"] == ["region-1"]
    # a weighted average of updates clipped to the bound moves the model by no more than the bound
    assert 0 < moved <= root_round.aggregation["clip_bound"] * (1 + 1e-5)
    assert root_round.aggregation["clip_bound"] <= 2 * root_round.aggregation["median_norm"] * (1 + 1e-6)


def test_a_rogue_regional_aggregator_of_three_is_screened_out_at_the_root(tmp_path: Path) -> None:
    """region-1's participant sends its region's step reversed and boosted x20, claiming 10^12 samples: before
    the federation's own bounds this took the root's loss to 4.4e20 in four committed rounds (a rogue region
    is a participant like any other: docs/results/robustness.md, "A rogue of three")."""
    with RegionFederation(tmp_path, regions=3, agents=6, rounds=3) as fed:
        participant = fed.regions["region-1"].participant
        attack = Attack.parse("scale:-20+samples:1000000000000")
        participant.runner.trainer = AttackingTrainer(participant.runner.trainer, attack, "region-1")
        rounds = fed.root_rounds(3, timeout_s=180)
    assert [m.outcome for m in rounds] == ["committed"] * 3
    assert all(list(m.aggregation["screened"]) == ["region-1"] for m in rounds), [m.aggregation for m in rounds]
    assert all(sorted(m.accepted) == ["region-1", "region-2", "region-3"] for m in rounds)
    assert rounds[-1].eval["loss"] < rounds[0].eval["loss"] < 2.3  # the honest regions' training goes on


# -- configuration ------------------------------------------------------------------------------------
@pytest.fixture
def region_config(tmp_path: Path) -> Path:
    settings = SimSettings(agents=2, rounds=1, regions=1, federation="t")
    return create_regions(tmp_path, settings, ("127.0.0.1", 1883), [("127.0.0.1", 1884)]).regions["region-1"]


def test_a_region_config_loads(region_config: Path) -> None:
    config = load_server_config(region_config)
    assert config.upstream is not None and config.upstream.id == "region-1" and config.upstream.federation == "t"
    assert config.upstream.broker is None  # its own broker, bridged


@pytest.mark.parametrize(
    "tables, message",
    [
        ({"server": {"rounds": 3}}, "set server.rounds = 0"),
        ({"upstream": {"federation": "t-region-1"}}, "give the region its own federation name"),
        ({"strategy": {"name": "fedswap"}}, "a region sends the root one aggregate"),
        ({"upstream": {"identity": "nope.key"}}, "upstream.identity = 'nope.key'"),
        ({"upstream": {"id": "a/b"}}, "upstream.id"),
        ({"upstream": {"broker": {"port": 0}}}, "upstream.broker: broker.port must be 1-65535"),
        ({"upstream": {"colour": "red"}}, "upstream.colour is not a known key"),
    ],
)
def test_a_bad_upstream_fails_at_start_naming_the_key(region_config: Path, tables: dict, message: str) -> None:
    override_toml(region_config, **tables)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_server_config(region_config)


def test_a_regions_start_checkpoint_is_refused_it_adopts_the_roots_model(region_config: Path) -> None:
    """``server.init_weights`` was read and never used: a region trains each round from the root's model."""
    data = toml.loads(region_config.read_text())
    data["server"].pop("eval_data")
    data["server"] |= {"model": "yolo11n", "classes": ["car"], "init_weights": "warm.pt"}
    write_toml(region_config, data)
    with pytest.raises(ConfigError, match=r"server\.init_weights is not used by a region's server \(with "
                       r"\[upstream\]\): a region adopts the root's model before each of its rounds"):  # fmt: skip
        load_server_config(region_config)


def test_agents_split_into_near_equal_consecutive_regions() -> None:
    names = [f"a{i}" for i in range(7)]
    assert split_agents(names, 3) == {"region-1": ["a0", "a1"], "region-2": ["a2", "a3", "a4"],
                                      "region-3": ["a5", "a6"]}  # fmt: skip


# -- the hand-off between the region's two halves --------------------------------------------------------
def _ask_in_thread(handoff: UpstreamHandoff, request: RootRound, timeout_s: float = 5.0) -> dict:
    outcome: dict = {}

    def ask() -> None:
        try:
            outcome["result"] = handoff.ask(request, timeout_s)
        except RegionalRoundFailed as exc:
            outcome["failed"] = str(exc)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    outcome["thread"] = thread
    wait_until(lambda: handoff.pending() is request or "failed" in outcome, 5, "the request")
    return outcome


def test_the_aggregate_of_the_round_asked_for_is_returned_once_its_round_closes() -> None:
    handoff, model = UpstreamHandoff(), {"w": np.ones(3, np.float32)}
    request = RootRound(round=4, attempt=1, model=model, deadline=time.time() + 60)
    outcome = _ask_in_thread(handoff, request)
    handoff.begun(request)
    assert handoff.pending() is None  # begun: not taken twice
    assert not handoff.deliver(RegionResult(3, model, weight=5))  # a stale round's result is dropped
    assert handoff.deliver(RegionResult(4, model, weight=7, loss=0.5))
    outcome["thread"].join(5)
    assert outcome["result"].weight == 7


@pytest.mark.parametrize("ending", ["newer", "timeout", "close", "rolled-back"])
def test_a_wait_that_cannot_end_in_an_aggregate_fails_with_the_reason(ending: str) -> None:
    handoff, model = UpstreamHandoff(), {"w": np.ones(3, np.float32)}
    request = RootRound(round=1, attempt=1, model=model, deadline=0.0)
    outcome = _ask_in_thread(handoff, request, timeout_s=0.3 if ending == "timeout" else 10.0)
    if ending == "newer":
        _ask_in_thread(handoff, RootRound(round=2, attempt=1, model=model, deadline=0.0))
    elif ending == "close":
        handoff.close()
    elif ending == "rolled-back":
        handoff.deliver(RegionResult(1, None, reason="rolled-back: too few updates"))
    outcome["thread"].join(5)
    expected = {"newer": "the root asked for a newer round", "timeout": "the root's deadline passed",
                "close": "the region stops", "rolled-back": "did not commit: rolled-back"}[ending]  # fmt: skip
    assert expected in outcome["failed"]


def test_a_regions_weight_counts_each_claim_as_its_bounds_did() -> None:
    """An agent claiming a million samples is capped in its region's aggregate, and in the weight the region
    claims at the root: the region does not pass the inflated claim up."""
    model = {"w": np.zeros(2, np.float32)}
    records = [UpdateRecord("a", 100, 1.0, 1.0, 10), UpdateRecord("b", 120, 2.0, 1.0, 10),
               UpdateRecord("liar", 1_000_000, 0.5, 1.0, 10)]  # fmt: skip
    capped = RegionResult.of_round(1, model, records, {}, sample_cap=200.0)
    assert capped.weight == 420 and capped.loss == pytest.approx((100 * 1.0 + 120 * 2.0 + 200 * 0.5) / 420)
    assert RegionResult.of_round(1, model, records, {}).weight == 1_000_220  # bounds off: as claimed


def test_one_agents_huge_finite_loss_leaves_its_regions_loss_finite() -> None:
    """An agent's loss need only be finite; 1e308 times its weight made the region's loss infinite, and the root
    refused the region's whole aggregate (``non-finite-loss``) for one agent's header."""
    model = {"w": np.zeros(2, np.float32)}
    records = [UpdateRecord("a", 100, 0.3, 1.0, 10), UpdateRecord("rogue", 100, 1e308, 1.0, 10),
               UpdateRecord("b", 100, sys.float_info.max, 1.0, 10)]  # fmt: skip
    loss = RegionResult.of_round(1, model, records, {}, sample_cap=200.0).loss
    assert math.isfinite(loss) and loss > 1e307


def test_a_regional_round_closes_in_time_for_the_roots_deadline(tmp_path: Path) -> None:
    """region-1 would wait 120 s for a straggler; the root waits 25 s. The region closes its round on its quorum
    before the root's deadline, and its aggregate of the agents that made it counts at the root."""
    slow_region = {"region-1": {"rounds": {"deadline_s": 120.0, "quorum": 1}}}
    with RegionFederation(tmp_path, regions=2, agents=4, rounds=1, root_tables={"rounds": {"deadline_s": 25.0}},
                          region_tables=slow_region) as fed:  # fmt: skip
        straggler = fed.agents["agent-02"]
        straggler.runner.trainer = SlowTrainer(straggler.runner.trainer, 2000.0)
        (root_round,) = fed.root_rounds(1, timeout_s=90)
        wait_until(lambda: fed.region_metrics("region-1"), 10, "region-1's metrics")
    assert sorted(root_round.accepted) == ["region-1", "region-2"], root_round
    (regional,) = fed.region_metrics("region-1")
    assert regional["accepted"] == ["agent-01"] and regional["missed"] == ["agent-02"]
    assert regional["duration_s"] < 25.0


def test_a_region_declines_a_root_round_whose_recipe_its_own_agents_do_not_follow():
    """A region's agents train with its own strategy's recipes: a root asking for another (FedProx's proximal pull
    to a FedAvg region, or another μ) is told so by name instead of getting an aggregate trained without it."""
    from participant.declined import TrainingDeclined
    from protocol.messages import RecipeRecord, TrainSettings
    from region.trainer import RegionalTrainer
    from tests.fedharness import round_task

    proximal = RecipeRecord("proximal", {"mu": 0.01})
    handoff = UpstreamHandoff()
    root_round = round_task(selected=["region-1"], deadline=time.time() - 1, train=TrainSettings(recipes=(proximal,)))
    with pytest.raises(TrainingDeclined, match=r"recipe-refused: the root asks for recipe proximal \{'mu': 0.01\}; "
                       r"this region's agents follow its own strategy's \(none\)"):  # fmt: skip
        RegionalTrainer(handoff, "region-1").train({}, root_round)
    with pytest.raises(TrainingDeclined, match="own strategy's \\(proximal \\{'mu': 0.1\\}\\)"):
        RegionalTrainer(handoff, "region-1", (RecipeRecord("proximal", {"mu": 0.1}),)).train({}, root_round)
    with pytest.raises(RegionalRoundFailed, match="the root's deadline passed"):  # the same recipe: it runs a round
        RegionalTrainer(handoff, "region-1", (proximal,)).train({}, root_round)
