"""The default aggregation (issue 21) and what the server says at start about the strategy it runs."""

import logging

import pytest

from broker_server.config import load_server_config
from broker_server.engine import RoundEngine
from broker_server.rounds import RoundRules
from broker_server.strategies import build_strategy
from broker_server.strategies.choice import DEFAULT_STRATEGY, strategy_notes, updates_per_round
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation


def test_the_default_is_centered_clip_and_explicit_choices_are_kept():
    assert DEFAULT_STRATEGY == "centered-clip" and build_strategy({}).name == "centered-clip"
    assert build_strategy({"name": "krum"}).name == "krum" and build_strategy({"name": "krum"}).options.f == 2
    assert build_strategy({"name": "fedavg"}).name == "fedavg"


def test_updates_per_round_follow_the_selection_rule():
    assert updates_per_round(10, RoundRules()) == 10
    assert updates_per_round(10, RoundRules(fraction=0.3, min_agents=2)) == 3
    assert updates_per_round(10, RoundRules(fraction=0.1, min_agents=5, quorum=2)) == 5
    assert updates_per_round(3, RoundRules(min_agents=5, quorum=2)) == 3


def test_no_strategy_name_logs_the_default_and_why():
    (note,) = strategy_notes({}, 3, RoundRules())
    assert note.level == logging.INFO
    assert note.text.startswith("aggregation default: centered-clip (3 agents enrolled, 3 updates a round; ")
    assert "within 1 point of FedAvg" in note.text


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
    assert "Enrol more agents, lower strategy.f, or remove strategy.name for the default (centered-clip)" in note.text


@pytest.mark.parametrize(
    "table, enrolled", [({"name": "krum"}, 7), ({"name": "krum", "f": 0}, 3), ({"name": "fedavg"}, 2)]
)
def test_a_strategy_that_gives_what_it_says_is_not_warned_about(table, enrolled):
    assert strategy_notes(table, enrolled, RoundRules()) == []


@pytest.mark.parametrize(
    "strategy, level, text",
    [
        ({}, logging.INFO, "aggregation default: centered-clip (3 agents enrolled"),
        ({"name": "krum", "f": 2}, logging.WARNING, "strategy krum f=2 needs 7 updates a round"),
    ],
)
def test_the_server_says_it_once_at_start_and_runs_what_it_says(tmp_path, caplog, strategy, level, text):
    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=1, strategy=strategy), ("127.0.0.1", 1))
    with caplog.at_level(logging.INFO, logger="skyfed.server"):
        engine = RoundEngine(load_server_config(layout.server_config), replay=ReplayGuard(3600))
    said = [r for r in caplog.records if text in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == level, caplog.text
    assert engine.strategy.name == strategy.get("name", "centered-clip")  # the status's ``strategy`` field


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
