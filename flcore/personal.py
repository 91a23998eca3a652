"""A round's personalization record from the agents' own reports and the evaluations at hand (docs/architecture.md,
"One headline per shape and kind of model"): the server's (``broker_server.rounds.personal``) adds its C-GEN of
the models it holds; a peer, which has no evaluation set with every class, says what its members reported.

Averages are plain means over the agents that reported (the seeds average over agents). Reported numbers are an
agent's claim, shown, never used to decide anything.
"""

from __future__ import annotations

from flcore.rounds import UpdateRecord
from protocol.messages import headline


def personal_metrics(c_spe: dict[str, dict], start_of: dict[str, str], c_gen_of: dict[str, dict]) -> dict:
    """``{"c_spe": mean, "c_gen": mean, "agents": {agent: {"c_spe": …, "c_gen": …}}}`` from each agent's
    report (``c_spe``: its start model on its test split), which model it started from (``start_of``:
    agent → key) and the server's evaluation of each such model (``c_gen_of``: key → evaluation)."""
    agents: dict[str, dict[str, float]] = {}
    for agent, key in sorted(start_of.items()):
        entry = {}
        if (spe := headline(c_spe.get(agent, {}))) is not None:
            entry["c_spe"] = round(float(spe), 6)
        if (gen := headline(c_gen_of.get(key, {}))) is not None:
            entry["c_gen"] = round(float(gen), 6)
        if entry:
            agents[agent] = entry
    if not agents:
        return {}
    means = {}
    for name in ("c_spe", "c_gen"):
        values = [entry[name] for entry in agents.values() if name in entry]
        if values:  # each scaled first: claimed values are finite but may be huge, and their sum could overflow
            means[name] = round(sum(v / len(values) for v in values), 6)
    return {**means, "agents": agents}


def claimed_personal(records: list[UpdateRecord]) -> dict:
    """The C-SPE each sender reported of the model it started the round from and of the model it trained
    (``trained``), per agent and as means: a peer round's ``personal`` (no C-GEN: a peer holds no evaluation set
    with every class). ``{}`` when nobody reported one (a detector's round)."""
    own = {r.agent: r.agent for r in records}
    start = personal_metrics({r.agent: r.start_eval for r in records}, own, {})
    trained = personal_metrics({r.agent: r.trained_eval for r in records}, own, {})
    return {**start, "trained": trained} if trained else start
