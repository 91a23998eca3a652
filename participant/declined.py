"""The one way a trainer says it will not train a round, with the reason the server's monitor shows."""


class TrainingDeclined(Exception):
    """The trainer will not train this round (local DP: it would pass the agent's epsilon budget; a recipe it
    cannot follow; a model that is not its to build)."""
