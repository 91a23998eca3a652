"""Personalization metrics of a round, of two models per agent (docs/architecture.md, "One headline per shape
and kind of model"):

- the model the agent *started* the round from: C-SPE, which the agent measures on its own test split before
  training and reports in its update header (``start_eval``), and C-GEN, the server's evaluation of that model on
  its evaluation set with every class. Under FedAvg every agent starts from the global model, so both are the
  global model's; under DemLearn an agent starts from its group's model, under FedAMP from its own cloud model,
  under swapping from its own or its partner's. A round's row describes the models trained from in that round,
  i.e. what the previous round gave each agent: the agent can only score a model once it has it.
- the model it *trained* (``trained``; the metric DemLearn's thesis and the FedAMN paper score): C-SPE as the
  agent measured it after training (``trained_eval``; Ditto's personal model, not the uploaded one), and C-GEN,
  the server's evaluation of the start model plus the uploaded change. The server scores at most
  ``server.score_trained`` uploads a round (a sample drawn with the round; ``scored`` says how many), never under
  differential privacy (a score of an un-noised model is outside the accounting), and only where the model an
  agent is judged by is one the server can hold (not Ditto's personal models). An upload that would be in the
  sample if every selected agent's counts is scored when it is accepted (``early``), while slower agents still
  train, not in the round's close after the last one: 20 evaluations took 0.7 s of a 100-agent round's close.

Averages are plain means over the agents that reported (the seeds average over agents). Reported numbers are an
agent's claim, shown, never used to decide anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import lru_cache

from flcore.personal import personal_metrics
from flcore.rounds import UpdateRecord
from models.weights import NamedArrays

GLOBAL = "global"  # the start key of agents that start from the global model


class StartScores:
    """The server's evaluation (C-GEN) of each model agents start a round from, computed once per model:
    under FedAvg that is the model the previous round published, already evaluated then (``known``)."""

    def __init__(self, evaluator: Callable[[NamedArrays], dict[str, float]] | None) -> None:
        self.evaluator = evaluator
        self._scores: dict[str, dict] = {}  # the last round's start models' evaluations, and the published model's
        self._round, self._carried = 0, self._scores  # the round being closed, and the evaluations it found
        self._early: dict[str, dict] = {}  # trained models of the round being closed, scored as accepted
        self._early_round = 0

    def known(self, key: str, evaluation: dict) -> None:
        self._scores[key] = evaluation

    def of(self, key: str) -> dict:
        """The evaluation of model ``key`` if this round's agents started from it ({}: not evaluated)."""
        return self._scores.get(key, {})

    def personal(self, round_number: int, updates: list[UpdateRecord], start_of: dict[str, str],
                 start_model: Callable[[str], NamedArrays], limit: int) -> dict:  # fmt: skip
        """``personal_metrics`` of a round whose counted ``updates`` came from agents that started from
        ``start_of`` (agent → model key; ``start_model`` gives an agent's whole start model), with the server's
        C-GEN of the global model in force, of every model it evaluated already and of at most ``limit`` others,
        drawn with ``round_number``."""
        if round_number != self._round:  # a close tried again (its checkpoint not written) starts from the same
            self._round, self._carried = round_number, self._scores
        holder = {key: agent for agent, key in sorted(start_of.items())}  # one agent per model, to fetch it by
        scores: dict[str, dict] = {}
        if self.evaluator is not None:  # None: the models agents are judged by are not the server's to score
            scores = {key: self._carried[key] for key in holder if key in self._carried}
            left = sorted(set(holder) - set(scores))
            in_force = [key for key in left if key.startswith(GLOBAL)]  # the global model: scored whatever the limit
            for key in in_force + _sample([key for key in left if key not in in_force], limit, round_number):
                scores[key] = self.evaluator(start_model(holder[key]))
        self._scores = scores  # only what this round's agents started from: the cache never grows
        metrics = personal_metrics({u.agent: u.start_eval for u in updates}, start_of, scores)
        return {**metrics, "scored": sum(key in scores for key in start_of.values())} if metrics else {}

    def early(self, round_number: int, selected: list[str], agent: str, trained_model: Callable[[str], NamedArrays],
              limit: int) -> None:  # fmt: skip
        """Score ``agent``'s trained model now, as its upload is accepted, if the round's sample would hold it
        were every ``selected`` agent's upload counted (``trained`` scores the rest of its sample itself)."""
        if round_number != self._early_round:
            self._early, self._early_round = {}, round_number
        if self.evaluator is not None and agent in _drawn(tuple(selected), limit, round_number):
            self._early[agent] = self.evaluator(trained_model(agent))

    def trained(self, round_number: int, updates: list[UpdateRecord], trained_model: Callable[[str], NamedArrays],
                limit: int) -> dict:  # fmt: skip
        """The trained models' ``personal_metrics`` (each agent's own model: its key is its name), with the server's
        C-GEN of at most ``limit`` of them (``trained_model`` gives an agent's start model plus its upload), drawn
        with ``round_number``; ``scored`` counts them."""
        agents = sorted(u.agent for u in updates)
        scored = _sample(agents, limit, round_number)
        early = self._early if round_number == self._early_round else {}
        scores = {} if self.evaluator is None else {
            agent: early[agent] if agent in early else self.evaluator(trained_model(agent)) for agent in scored}
        metrics = personal_metrics({u.agent: u.trained_eval for u in updates}, {a: a for a in agents}, scores)
        return {**metrics, "scored": len(scores)} if metrics else {}


def _sample(names: list[str], limit: int, round_number: int) -> list[str]:
    """At most ``limit`` of ``names``: those ranked first by a hash of the round and the name, so the same draw for
    the same round and names (a close tried again scores the same models), and a name in the draw from a set stays
    in it from any subset holding it."""
    if len(names) <= limit:
        return sorted(names)
    return sorted(sorted(names, key=lambda name: hashlib.sha256(f"{round_number}\0{name}".encode()).digest())[:limit])


@lru_cache(maxsize=4)
def _drawn(names: tuple[str, ...], limit: int, round_number: int) -> frozenset[str]:
    """``_sample`` as a set, drawn once a round: every accepted upload asks whether it is in the draw, and at 1,000
    agents drawing again (a hash per name) was 9 % of the server's time (py-spy)."""
    return frozenset(_sample(list(names), limit, round_number))
