"""What a round is judged by, in order: the scores every surface shows first (docs/architecture.md,
"One headline per shape and kind of model").

A run that keeps one global model is judged by that model on the server's evaluation set (accuracy, or
mAP@.5 for a detector). A run that keeps a model per group (DemLearn) or per agent (FedAMP, FedAMN) is
judged by those models: C-SPE (each agent's start model on its own test split) first, then the trained
models' C-SPE (the seeds' metric, ``broker_server.rounds.personal``), then C-GEN of each (on the server's set
with every class), then the global model beside them. The server computes the list once per round
(``RoundMetrics.headline``) so the console, ``skyfed monitor``, the dashboard and ``skyfed report`` cannot
disagree about which number leads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MODEL_KINDS = ("global", "group", "agent")  # what a strategy leaves agents with: ``Strategy.models``
LABELS = {
    "c_spe": "C-SPE",
    "c_gen": "C-GEN",
    "trained_c_spe": "trained C-SPE",
    "trained_c_gen": "trained C-GEN",
    "accuracy": "accuracy",
    "map50": "mAP@.5",
    "map50_95": "mAP@.5:.95",
    "loss": "loss",
    "box_loss": "box loss",
    "cls_loss": "cls loss",
    "dfl_loss": "dfl loss",
}
GLOBAL_KEYS = ("accuracy", "map50", "map50_95", "loss", "box_loss", "cls_loss", "dfl_loss")  # in this order
PERSONAL_KEYS = ("c_spe", "trained_c_spe", "c_gen", "trained_c_gen")  # in this order
TRAINED = "trained_"  # a personal key of the trained models: ``personal["trained"][key without it]``


def round_headline(models: str, evaluation: Mapping[str, Any], personal: Mapping[str, Any]) -> list[dict]:
    """``[{"key", "label", "value"}, …]``, the lead score first: the personal means before the global
    model's scores when agents keep their own (``models`` ``group`` or ``agent``), after them otherwise.
    Only finite numbers present in the round appear; a round with none gives ``[]``."""
    prefix = "global " if models != "global" else ""
    held = {**evaluation, **{k: personal_score(personal, k) for k in PERSONAL_KEYS}}
    scores = (_score(k, held.get(k), prefix) for k in headline_order(models))
    return [s for s in scores if s is not None]


def personal_score(personal: Mapping[str, Any], key: str) -> Any:
    """The value of personal key ``key`` in a round's ``personal`` (``trained_c_spe``: its ``trained.c_spe``)."""
    if key.startswith(TRAINED):
        trained = personal.get("trained")
        return trained.get(key.removeprefix(TRAINED)) if isinstance(trained, Mapping) else None
    return personal.get(key)


def headline_order(models: str) -> tuple[str, ...]:
    """Every key a headline of ``models`` can hold, in the order they lead."""
    return (*PERSONAL_KEYS, *GLOBAL_KEYS) if models != "global" else (*GLOBAL_KEYS, *PERSONAL_KEYS)


def row_headline(row: Mapping[str, Any]) -> list[dict]:
    """The headline of a ``metrics.jsonl`` row, derived again from its numbers (never read from the file): a row
    written before ``models`` existed, or a peer's row, is a global model's."""
    models = row.get("models", "global")
    evaluation, personal = row.get("eval"), row.get("personal")
    return round_headline(models if models in MODEL_KINDS else "global",
                          evaluation if isinstance(evaluation, Mapping) else {},
                          personal if isinstance(personal, Mapping) else {})  # fmt: skip


def headline_text(headline: list[dict], *, width: int = 3) -> str:
    """The first ``width`` scores as ``label value`` pairs, for a console or a log line."""
    return "  ".join(f"{s['label']} {s['value']:.4f}" for s in headline[:width])


def _score(key: str, value: Any, prefix: str) -> dict | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float (JSON allows 4,300 digits): not a score either
        return None
    label = LABELS[key]
    return {"key": key, "label": f"{prefix}{label}" if key in GLOBAL_KEYS else label, "value": number}
