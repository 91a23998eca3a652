"""The default aggregation (docs/results/robustness.md) and what the server says at start about the strategy it runs."""

import logging
import math

import numpy as np
import pytest

from broker_server.config import load_server_config
from broker_server.rounds.engine import RoundEngine
from flcore.rounds import RoundRules
from flcore.strategies import build_strategy
from flcore.strategies.auto import agreement
from flcore.strategies.choice import DEFAULT_STRATEGY, strategy_notes, updates_per_round
from flcore.strategies.krum import gram_matrix
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fixtures import contributions


def test_the_default_adapts_and_explicit_choices_are_kept():
    assert DEFAULT_STRATEGY == "auto" and build_strategy({}).name == "auto"
    assert build_strategy({"name": "krum"}).name == "krum" and build_strategy({"name": "krum"}).options.f == 2
    assert build_strategy({"name": "fedavg"}).name == "fedavg"


def test_updates_per_round_follow_the_selection_rule():
    assert updates_per_round(10, RoundRules()) == 10
    assert updates_per_round(10, RoundRules(fraction=0.3, min_agents=2)) == 3
    assert updates_per_round(10, RoundRules(fraction=0.1, min_agents=5, quorum=2)) == 5
    assert updates_per_round(3, RoundRules(min_agents=5, quorum=2)) == 3


def test_no_strategy_name_logs_what_the_default_will_do_with_this_fleet():
    (small,) = strategy_notes({}, 3, RoundRules())
    assert small.level == logging.INFO
    assert small.text.startswith("aggregation default: auto (3 agents enrolled, 3 updates a round): centered-clip "
                                 "every round while rounds bring fewer than 7 updates (Krum f=2's minimum)")
    (big,) = strategy_notes({}, 10, RoundRules())
    assert big.text.startswith("aggregation default: auto (10 agents enrolled, 10 updates a round): Krum f=2 if the "
                               "agents' updates agree >= 0.7 in the first round of 7 or more")
    (named,) = strategy_notes({"name": "auto", "f": 1, "agreement": 0.5}, 5, RoundRules())
    assert named.text.startswith("aggregation auto (5 agents enrolled, 5 updates a round): Krum f=1 if the agents' "
                                 "updates agree >= 0.5")


def alike(n, spread, seed=0, size=64):
    """``n`` updates around one direction; ``spread`` scales each one's own part (0: all equal)."""
    rng = np.random.default_rng(seed)
    common = rng.normal(size=size)
    return [(common + spread * rng.normal(size=size)).astype(np.float32) for _ in range(n)]


def test_agreement_is_the_median_agents_median_cosine_and_a_minority_barely_moves_it():
    assert agreement(gram_matrix(contributions(alike(10, 0.0)))) == pytest.approx(1.0)
    honest = alike(10, 1.0)
    clean = agreement(gram_matrix(contributions(honest)))
    flipped = [-d for d in honest[:2]] + honest[2:]
    assert 0.3 < clean < 0.7 and abs(agreement(gram_matrix(contributions(flipped))) - clean) < 0.1
    zero = [np.zeros(64, np.float32)] + honest[1:]  # an empty update agrees with nothing, and divides by nothing
    assert math.isfinite(agreement(gram_matrix(contributions(zero))))


def test_auto_runs_krum_on_alike_updates_and_keeps_the_choice_across_a_restart():
    strategy = build_strategy({})
    honest = alike(10, 0.3)
    attacked = [-10 * honest[0]] + honest[1:]
    result = strategy.aggregate(np.zeros(64, np.float32), contributions(attacked))
    assert result.detail["chose"] == "krum" and result.detail["decided"] and "a0" not in result.detail["selected"]
    assert result.detail["why"].startswith("updates agreed 0.") and "look alike" in result.detail["why"]
    assert math.isnan(strategy.state()["agreement"][0])  # a round rolled back measures nothing
    strategy.on_commit(result)
    restarted = build_strategy({})
    restarted.restore(strategy.state())
    # centered clipping's reference followed Krum's step: the next round's clipping is centred on it
    np.testing.assert_allclose(restarted.clip.reference, result.global_vector, atol=1e-6)
    later = restarted.aggregate(result.global_vector, contributions(alike(10, 5.0, seed=1)))  # no re-measuring
    assert later.detail["chose"] == "krum" and "decided" not in later.detail
    few = restarted.aggregate(result.global_vector, contributions(honest[:6]))
    assert few.detail["chose"] == "centered-clip" and few.detail["why"] == "6 updates: Krum f=2 needs 7"


def test_auto_runs_centered_clip_on_skewed_updates_and_with_too_few_to_measure():
    strategy = build_strategy({})
    few = strategy.aggregate(np.zeros(64, np.float32), contributions(alike(6, 0.3)))
    assert few.detail["chose"] == "centered-clip" and few.detail["agreement"] is None
    assert few.detail["why"] == "6 updates, agreement is measured on 7 (Krum f=2's minimum)"
    strategy.on_commit(few)
    skewed = strategy.aggregate(np.zeros(64, np.float32), contributions(alike(10, 3.0)))
    assert skewed.detail["chose"] == "centered-clip" and skewed.detail["decided"]
    assert skewed.detail["why"].startswith("updates agreed 0.") and "the agents' data differ" in skewed.detail["why"]
    with pytest.raises(ValueError, match=r"strategy.agreement must be a cosine similarity in \[-1, 1\], got 2"):
        build_strategy({"agreement": 2})
    with pytest.raises(ValueError, match="strategy.f must be >= 1"):
        build_strategy({"name": "auto", "f": 0})


@pytest.mark.parametrize(
    "table, enrolled, rules, expected",
    [
        ({"name": "krum"}, 3, RoundRules(), "strategy krum f=2 needs 7 updates a round; with 3 agents enrolled "
                                            "(3 updates a round) f is lowered to 0: no protection"),
        ({"name": "krum", "f": 2}, 6, RoundRules(), "f is lowered to 1: protection from 1 only"),
        ({"name": "krum", "f": 2}, 10, RoundRules(fraction=0.5), "with 10 agents enrolled (5 updates a round) f is "
                                                                 "lowered to 1"),
    ],
)  # fmt: skip
def test_krum_whose_f_the_fleet_cannot_give_is_a_warning(table, enrolled, rules, expected):
    (note,) = strategy_notes(table, enrolled, rules)
    assert note.level == logging.WARNING and expected in note.text, note.text
    assert "Enrol more agents, lower strategy.f, or remove strategy.name for the default (auto)" in note.text


@pytest.mark.parametrize(
    "table, enrolled", [({"name": "krum"}, 7), ({"name": "krum", "f": 0}, 3), ({"name": "fedavg"}, 2)]
)
def test_a_strategy_that_gives_what_it_says_is_not_warned_about(table, enrolled):
    assert strategy_notes(table, enrolled, RoundRules()) == []


@pytest.mark.parametrize(
    "strategy, level, text",
    [
        ({}, logging.INFO, "aggregation default: auto (3 agents enrolled"),
        ({"name": "krum", "f": 2}, logging.WARNING, "strategy krum f=2 needs 7 updates a round"),
    ],
)
def test_the_server_says_it_once_at_start_and_runs_what_it_says(tmp_path, caplog, strategy, level, text):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=1, strategy=strategy), ("127.0.0.1", 1))
    with caplog.at_level(logging.INFO, logger="skyfed.server"):
        engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    said = [r for r in caplog.records if text in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == level, caplog.text
    assert engine.strategy.name == strategy.get("name", "auto")  # the status's ``strategy`` field


def test_the_default_grid_runs_every_clean_cell_first_and_drops_a_clear_clean_failure():
    from sim.sweep_defaults import cells, dropped, table

    order = cells(["iid", "shards"], ["clean", "sign-flip"], ["fedavg", "krum f=2"], [0, 1])
    assert [c[1] for c in order] == ["clean"] * 8 + ["sign-flip"] * 8
    rows = [
        {"partition": "shards", "condition": "clean", "strategy": s, "seed": seed, "final_accuracy": a}
        for s, accs in (("fedavg", (0.70, 0.74)), ("krum f=2", (0.60, 0.66)))
        for seed, a in enumerate(accs)
    ]
    assert dropped(rows, "shards", "krum f=2", 5.0) and not dropped(rows, "shards", "krum f=2", 10.0)
    assert not dropped(rows, "shards", "fedavg", 0.0) and not dropped(rows, "iid", "krum f=2", 0.0)
    lines = table(rows, ["shards"], ["fedavg", "krum f=2"], 5.0).splitlines()
    assert lines[2].startswith("| shards | fedavg | 72.0 ± 2.8 (+0.0 / +0.0, 2 seeds) | not run |")
    assert lines[3].startswith("| shards | krum f=2 | 63.0 ± 4.2 (-9.0 / +0.0, 2 seeds) | dropped |")
