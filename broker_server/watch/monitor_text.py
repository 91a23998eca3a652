"""How ``skyfed monitor`` writes a value it received: plain text, one line, bounded (common.text), numbers
in a fixed short form; and each event as one ``kind key=value …`` line for a pipe or the journal."""

from __future__ import annotations

from rich.text import Text

from common.text import printable
from protocol.messages import AgentStatus, RoundMetrics, ServerStatus, headline
from protocol.peer_messages import Adoption, PeerBest, PeerMember, PeerRoundMetrics
from protocol.scores import round_headline

MAX_CELL = 800  # characters of one free-text value shown (an agent's detail names a fix)
MAX_SHORT = 64  # characters of a name or a number (a topic level is 64 at most; a 4,000-digit round is not)


def _count(listed: object) -> int:
    """How many items a payload's list holds (anything else: none): a metrics topic is anyone's to write to."""
    return len(listed) if isinstance(listed, list) else 0


def cells(*values: object, limit: int = MAX_SHORT) -> list[Text]:
    """Plain text cells: a status string such as ``[/oops]`` is shown, never parsed as markup, and an escape
    sequence in it (clipboard write, screen clear, concealed text) is shown escaped, never sent to the terminal."""
    return [Text(printable(str(v), limit)) for v in values]


def score(value: object) -> str:
    """A score or loss: four decimals, or four digits where it is out of any score's range; ``-`` if none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    try:
        value = float(value)
    except OverflowError:  # an integer claim beyond any float
        return "(too large)"
    return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"


def number(value: float, scale: float = 1.0, digits: int = 1) -> str:
    """A size or a duration, scaled; a claim too large for a float (a 4,000-digit integer) is shown as such."""
    try:
        scaled = float(value) / scale
    except OverflowError:
        return "(too large)"
    return f"{scaled:.{digits}f}" if abs(scaled) < 1e9 else f"{scaled:.3g}"


def global_scores(evaluation: dict) -> list[dict]:
    """A global model's scores, lead first (protocol.scores): a server status' or a peer's ``eval``."""
    return round_headline("global", evaluation, {})


def gate_text(ok: bool, reasons: list[str]) -> str:
    return "ok" if ok else "blocked: " + ", ".join(reasons)


def member_text(member: PeerMember) -> str:
    return member.state if member.gate.ok else f"{member.state}, gate {gate_text(False, member.gate.reasons)}"


def _line(kind: str, **fields: object) -> str:
    """``kind key=value ...``, every value one printable run (a pipe or journald gets one line each)."""
    return " ".join([kind, *(f"{k}={printable(str(v), MAX_CELL)}" for k, v in fields.items())])


def _score_fields(scores: list[dict]) -> dict[str, str]:
    """A headline as fields, lead first, keyed as in ``eval`` and ``personal`` (``accuracy``, ``map50``,
    ``c_spe``, …): a script finds the same key whatever the kind of model."""
    return {s["key"]: score(s["value"]) for s in scores}


def server_line(s: ServerStatus) -> str:
    buffer = {"buffer": f"{s.buffer.get('filled')}/{s.buffer.get('size')}", "in_flight": s.buffer.get("in_flight")} \
        if s.buffer else {}  # asynchronous rounds  # fmt: skip
    return _line("server", federation=s.federation, state=s.state, round=s.round, phase=s.phase,
                 strategy=s.strategy, model=f"v{s.model_version}", agents_online=s.agents_online, **buffer,
                 eval=score(headline(s.eval)), detail=s.detail)  # fmt: skip


def agent_line(name: str, a: AgentStatus, note: str) -> str:
    return _line("agent", id=name, state=a.state + (f" ({note})" if note else ""), round=a.round,
                 done=a.last_completed_round, samples=a.samples, model=f"v{a.version}",
                 gate=gate_text(a.gate.ok, a.gate.reasons), detail=a.detail)  # fmt: skip


def metrics_line(m: RoundMetrics) -> str:
    """The round's headline first, then the fields scripts had before it (``metric``: the global model's
    accuracy or mAP@.5, as it always was)."""
    return _line("round", round=m.round, outcome=m.outcome, reason=m.reason, **_score_fields(m.headline),
                 accepted=f"{len(m.accepted)}/{len(m.participants)}", rejected=len(m.rejected),
                 folded_late=_count(m.aggregation.get("folded_late")), metric=score(headline(m.eval)),
                 seconds=number(m.duration_s), **_buffer_fields(m))  # fmt: skip


def history_line(row: dict) -> str:
    """A round from the retained ``server/history`` (``history.read_history``), one started before the monitor:
    its headline keyed as in ``metrics_line``, and the counts the history keeps."""
    return _line("history", round=row["round"], outcome=row["outcome"], **{k: score(v) for k, v in row["headline"]},
                 accepted=row.get("accepted", "-"), rejected=row.get("rejected", "-"),
                 mb_up=_megabytes(row.get("bytes_up")), mb_down=_megabytes(row.get("bytes_down")))  # fmt: skip


def _megabytes(value: object) -> str:
    return number(value, 1e6, 2) if type(value) in (int, float) else "-"


def _buffer_fields(m: RoundMetrics) -> dict[str, object]:
    """An asynchronous round's version, staleness and lost updates; a synchronous one's lost updates."""
    fields: dict[str, object] = {f"lost_{kind}": n for kind, n in sorted(m.wasted.items()) if isinstance(n, int)}
    if m.buffer:
        fields = {"version": m.model_version, "staleness_mean": m.buffer.get("staleness_mean"),
                  "staleness_max": m.buffer.get("staleness_max"), **fields}  # fmt: skip
    return fields


def peer_member_line(m: PeerMember, note: str = "") -> str:
    return _line("peer", id=m.peer, state=member_text(m) + (f" ({note})" if note else ""), round=m.round)


def peer_metrics_line(m: PeerRoundMetrics) -> str:
    return _line("peer-round", id=m.peer, round=m.round, outcome=m.outcome, reason=m.reason,
                 **_score_fields(round_headline("global", m.eval, m.personal)), aggregated_from=len(m.aggregated_from),
                 folded_late=_count(m.aggregation.get("folded_late")), rejected=len(m.rejected))  # fmt: skip


def peer_best_line(b: PeerBest) -> str:
    """Its claim; once it elected, also the model it adopted, whose, and its score on this peer's split."""
    a = b.adopted
    decided = {"adopted": a.sha256[:16], "adopted_from": a.owner, "adopted_score": score(a.score)} if a.sha256 else {}
    return _line("peer-best", id=b.peer, round=b.round, score=score(b.score), sha256=b.sha256[:16], **decided)


def adopted_text(a: Adoption) -> str:
    return f"{a.owner}'s ({a.sha256[:12]}), {score(a.score)} here"
