"""The round engine's decisions: selection, quorum, deadline, re-announcement."""

import pytest

from flcore.rounds import RoundRules, RoundState, UpdateRecord, decide, select_agents


def _accepted(*agents):
    return [UpdateRecord(agent=a, samples=10, loss=0.1, norm=1.0, wire_bytes=100) for a in agents]


def test_selection_honours_fraction_and_minimum_and_is_reproducible():
    agents = [f"a{i}" for i in range(10)]
    rules = RoundRules(fraction=0.3, min_agents=2, quorum=1)
    picked = select_agents(agents, rules, seed=7)
    assert len(picked) == 3 and set(picked) <= set(agents)
    assert picked == select_agents(list(reversed(agents)), rules, seed=7)
    assert len(select_agents(agents, RoundRules(fraction=0.05, min_agents=4, quorum=2), seed=1)) == 4


def test_round_closes_when_everyone_reported_or_deadline_with_quorum():
    rules = RoundRules(min_agents=3, quorum=2, deadline_s=10)
    state = RoundState(round=1, attempt=1, selected=["a", "b", "c"], deadline=100.0, started_at=90.0)
    assert decide(state, rules, now=95) == "wait"
    state.updates += _accepted("a", "b")
    assert decide(state, rules, now=95) == "wait"
    assert decide(state, rules, now=101) == "close"
    state.updates += _accepted("c")
    assert decide(state, rules, now=95) == "close"


def test_an_agent_whose_update_was_refused_is_not_waited_for():
    rules = RoundRules(min_agents=3, quorum=2)
    state = RoundState(1, attempt=1, selected=["a", "b", "c"], deadline=100.0, started_at=0.0, updates=_accepted("a"))
    state.failed.append("c")
    assert state.pending == ["b"] and decide(state, rules, now=5) == "wait"
    state.updates += _accepted("b")
    assert decide(state, rules, now=5) == "close"  # long before the deadline
    lonely = RoundState(2, attempt=1, selected=["a", "b"], deadline=100.0, started_at=0.0, updates=_accepted("a"))
    lonely.failed.append("b")
    assert decide(lonely, rules, now=5) == "wait" and decide(lonely, rules, now=101) == "reannounce"  # no quorum


def test_deadline_without_quorum_reannounces_to_pending_agents():
    rules = RoundRules(min_agents=3, quorum=2)
    state = RoundState(4, attempt=1, selected=["a", "b", "c"], deadline=10.0, started_at=0.0, updates=_accepted("b"))
    assert decide(state, rules, now=11) == "reannounce"
    assert state.pending == ["a", "c"]
    assert RoundState.from_dict(state.to_dict()) == state


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"fraction": 0}, "rounds.fraction"),
        ({"min_agents": 0}, "rounds.min_agents"),
        ({"min_agents": 2, "quorum": 3}, "rounds.quorum"),
        ({"deadline_s": 0}, "rounds.deadline_s"),
    ],
)
def test_bad_round_rules_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        RoundRules(**kwargs)
