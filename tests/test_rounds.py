"""The round engine's decisions: selection, quorum, deadline, re-announcement."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flcore.rounds import RoundRules, RoundState, UpdateRecord, complete, decide, select_agents


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


def _complete_as_defined(state, rules, threshold, arriving):  # noqa: ANN001, ANN202
    """``complete`` as its docstring defines it, the lists computed in full."""
    if rules.is_async:
        return len(state.updates) + len(arriving) >= rules.buffer
    delivered = state.delivered + len(arriving)
    waited = [agent for agent in state.waited_for if agent not in arriving]
    return (not waited and delivered >= rules.quorum) or (threshold > 0 and delivered >= threshold)


@settings(max_examples=600, deadline=None)
@given(data=st.data())
def test_complete_with_its_shortcut_says_what_the_full_lists_say(data):
    """``complete`` answers most calls from the lists' lengths alone (a bound on who is still waited for); any mix
    of accepted, late, failed, missed, locally trained and probation agents gets the answer of the full lists: each
    agent in one of them, and then, maybe, in others too."""
    names = [f"a{i}" for i in range(data.draw(st.integers(1, 8)))]
    roles = ("accepted", "failed", "missed", "trained", "probation", "waited")
    role = {name: data.draw(st.sampled_from(roles)) for name in names}
    extra = data.draw(st.booleans())  # overlaps: an agent in two lists, late updates

    def of(kind: str) -> list[str]:
        more = data.draw(st.lists(st.sampled_from(names), unique=True)) if extra else []
        return sorted({name for name in names if role[name] == kind} | set(more))

    state = RoundState(round=2, attempt=1, selected=names, deadline=100.0, started_at=0.0)
    state.updates = [UpdateRecord(agent=a, samples=1, loss=0.1, norm=1.0, wire_bytes=1) for a in of("accepted")]
    state.updates += [UpdateRecord(agent=a, samples=1, loss=0.1, norm=1.0, wire_bytes=1, late_from=1)
                      for a in (of("late") if extra else [])]  # fmt: skip
    state.failed, state.missed, state.trained, state.probation = of("failed"), of("missed"), of("trained"), of(
        "probation")
    quorum = data.draw(st.integers(1, 8))
    rules = RoundRules(min_agents=quorum, quorum=quorum)
    threshold = data.draw(st.integers(0, 8))
    arriving = frozenset(name for name in names if role[name] in ("waited", "probation") and data.draw(st.booleans()))
    assert complete(state, rules, threshold, arriving) == _complete_as_defined(state, rules, threshold, arriving)
