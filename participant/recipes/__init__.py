"""Client-side training recipes (docs/architecture.md, "Recipes"): one module each, registered here by one line.

A strategy names the recipes its round task asks for (``TrainSettings.recipes``); the server checks each
record with ``checked`` before it signs the task, and a participant's trainer loads them with ``recipes_for``,
which declines the round with the reason when the record is not one this participant can follow.
"""

from __future__ import annotations

from dataclasses import replace

from common.registry import Registry, UnknownPlugin
from participant.declined import TrainingDeclined
from participant.recipes.base import Knobs, LocalRun, Recipe
from protocol.messages import RecipeRecord, TrainSettings
from protocol.typed import SchemaError, build

RECIPES: Registry[type[Recipe]] = Registry("recipe", "recipe")
RECIPES.add("proximal", "participant.recipes.proximal:ProximalPull")
RECIPES.add("partial-work", "participant.recipes.partial_work:PartialWork")
RECIPES.add("attention", "participant.recipes.attention:MetaAttention")
RECIPES.add("ditto", "participant.recipes.ditto:Ditto")
RECIPES.add("fedper", "participant.recipes.fedper:PersonalHead")


def build_recipe(record: RecipeRecord) -> Recipe:
    """The recipe ``record`` names with its options validated; ``ValueError`` says why not (its name, its version,
    the option's key)."""
    try:
        kind = RECIPES.get(record.name)
    except UnknownPlugin:
        raise ValueError(f"recipe {record.name!r} is not one this SkyFed has (it has {', '.join(RECIPES.names())}): "
                         "update it to the server's version") from None  # fmt: skip
    if record.version != kind.version:
        raise ValueError(f"recipe {record.name!r} version {record.version} is not this SkyFed's version {kind.version}"
                         ": run the same SkyFed release on the server and the participants")  # fmt: skip
    try:
        return kind(build(kind.Options, record.options, where=f"recipe {record.name}", strict=True))
    except (SchemaError, ValueError) as exc:
        raise ValueError(str(exc)) from None


def checked(record: RecipeRecord) -> RecipeRecord:
    """``record`` stamped with the registered recipe's version, once its options validate (the server's side)."""
    kind = RECIPES.get(record.name)
    stamped = replace(record, version=kind.version)
    build_recipe(stamped)
    return stamped


def checked_settings(settings: TrainSettings) -> TrainSettings:
    """``settings`` with every recipe record ``checked``: what the server signs."""
    return replace(settings, recipes=tuple(checked(r) for r in settings.recipes))


def refusal(record: RecipeRecord, trainer: str) -> str:
    """Why a ``trainer`` (``classifier``, ``detector``) cannot follow ``record``, or ``""``."""
    try:
        recipe = build_recipe(record)
    except ValueError as exc:
        return str(exc)
    if trainer not in recipe.trainers:
        return f"recipe {record.name!r} needs a {' or '.join(sorted(recipe.trainers))} trainer, not a {trainer}"
    return ""


def recipes_for(settings: TrainSettings, trainer: str) -> list[Recipe]:
    """The round's recipes for a ``trainer``; ``TrainingDeclined`` names the one it cannot follow and why."""
    for record in settings.recipes:
        if why := refusal(record, trainer):
            raise TrainingDeclined(f"recipe-refused: {why}")
    return [build_recipe(record) for record in settings.recipes]


def knobs_of(recipes: list[Recipe]) -> Knobs:
    """What ``recipes`` set of the plain SGD loop, applied in order."""
    knobs = Knobs()
    for recipe in recipes:
        knobs = recipe.knobs(knobs)
    return knobs


def work_share(settings: TrainSettings) -> float:
    """The share of the local work ``settings`` ask for (1 unless a recipe lowers it); for pacing and DP accounting,
    which run before a trainer could decline."""
    try:
        return knobs_of([build_recipe(r) for r in settings.recipes]).work
    except ValueError:
        return 1.0


__all__ = ["RECIPES", "Knobs", "LocalRun", "Recipe", "build_recipe", "checked", "checked_settings", "knobs_of",
           "recipes_for", "refusal", "work_share"]
