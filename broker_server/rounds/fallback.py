"""A round that cannot reach its quorum with nobody left to ask, and the model to go back to.

Before, a round whose every selected agent had been refused was re-announced at each deadline to an
empty list of pending agents, for ever (a model made bad by a rogue participant: every honest update then
came back non-finite). Now such a round is closed as rolled back with the reason (``stuck``), and the next
one opens as usual. When most of the agents it selected had their update refused as non-finite, the model
in force is what is broken, not the agents: the model before it comes back as a new version, which the next task names
(``docs/architecture.md``, "Safe commit"). The model before is the checkpoint's own
``global-v<version>.safetensors`` of the version that was replaced, kept while ``Fallback`` names it: no
extra write per round. One level: a second broken model in a row finds no fallback, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flcore.rounds import RoundState
from flcore.validation import reason_kind

NON_FINITE = frozenset({"non-finite-values", "non-finite-loss"})


@dataclass
class Fallback:
    """The version before the model in force (0: none) and its evaluation, kept in the checkpoint."""

    version: int = 0
    evaluation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"version": self.version, "eval": self.evaluation}

    @classmethod
    def from_dict(cls, data: dict | None) -> Fallback:
        data = data or {}
        version = data.get("version", 0)
        return cls(version if isinstance(version, int) else 0, dict(data.get("eval") or {}))


def stuck_reason(rs: RoundState, quorum: int) -> tuple[str, list[str]]:
    """The rolled-back reason and offenders of a round closed because nobody is left to ask."""
    kinds = sorted({reason_kind(r["reason"]) for r in rs.rejected if r["agent"] in rs.failed})
    why = f"stuck: {rs.delivered} of {quorum} updates at the deadline and nobody left to ask"
    return (f"{why}; refused: {','.join(kinds)}" if kinds else why), sorted(rs.failed)


def broken_model(rs: RoundState) -> bool:
    """Whether the round says the model in force cannot be trained on: most of the agents it selected had their
    update refused for non-finite values (honest agents trained it into NaN or overflow). A majority, not every
    refusal: one rogue must neither veto the fallback (a malformed update of its own) nor pull it alone (its NaN
    while the others gave up)."""
    non_finite = {r["agent"] for r in rs.rejected if r["agent"] in rs.failed and reason_kind(r["reason"]) in NON_FINITE}
    return 2 * len(non_finite) > len(rs.selected)
