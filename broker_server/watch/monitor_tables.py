"""``skyfed monitor``'s tables, drawn from a ``FederationView``: the server, its agents (a root's regions), the
last rounds led by each round's headline (docs/architecture.md, "One headline per shape and kind of model"),
and a peer federation's peers. Every value from the network goes through ``monitor_text.cells``."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from broker_server.watch.history import PastRounds
from broker_server.watch.monitor_text import (
    MAX_CELL,
    adopted_text,
    cells,
    gate_text,
    global_scores,
    member_text,
    number,
    score,
)
from broker_server.watch.monitor_view import ROUNDS_KEPT, Elected, FederationView, PeerState, elected
from protocol.buffer_text import buffer_text, wasted_text
from protocol.messages import RoundMetrics
from protocol.scores import personal_score, round_headline

MAX_ROWS = 100  # agents or peers drawn; a flood of invented names is counted, not drawn
ENDED = ("finished", "budget_exhausted", "stopped")  # a server's retained state once it ended (status_report)
SCORE_COLUMNS = 6  # headline scores a round's row shows, lead first (a personal run's four, then two global)
MAX_GROUPS = 12  # DemLearn groups listed under the rounds
MAX_MEMBERS = 8  # names listed per group


def render(view: FederationView) -> Group:
    """Tables of the last status and metrics; every value from the network is shown as plain text."""
    parts: list[Any] = []
    if view.server is not None or not view.peers:
        parts.append(_server_table(view))
        parts += [_agents_table(view), *_agent_notes(view)]
    if view.peers:
        parts += [_peers_table(view), *_peer_notes(view)]
    if view.metrics or view.past.rows:
        parts.append(_rounds_table(view.metrics, view.past))
        parts += _groups(view.metrics[-1]) if view.metrics else []
    elif not view.peers:
        parts.append(Text("no round has finished since the monitor started, and the server keeps no history of them"))
    return Group(*parts)


def _table(title: str, *columns: str) -> Table:
    table = Table(title=Text(title), show_header=True, title_justify="left")
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


def _lead(scores: list[dict]) -> str:
    return f"{scores[0]['label']} {score(scores[0]['value'])}" if scores else "-"


def _server_table(view: FederationView) -> Table:
    head = Table(title=Text(f"SkyFed federation {view.topics.federation!r}"), show_header=True)
    for col in ("server", "round", "phase", "strategy", "model", "score", "agents online", "rejections"):
        head.add_column(col, overflow="fold")
    if (s := view.server) is not None:
        phase = f"{s.phase} ({s.action})" if s.action not in ("", "average") else s.phase
        model = f"v{s.model_version}" + (f", best v{s.best['version']}" if s.best.get("version") else "")
        strategy = s.strategy
        if s.privacy:  # differential privacy: what the worst-off agent has spent
            strategy += f", ε {s.privacy.get('epsilon')} of {s.privacy.get('target_epsilon') or '∞'}"
        models = view.metrics[-1].models if view.metrics else "global"  # "global accuracy" beside C-SPE
        shown = _lead(round_headline(models, s.eval, {}))
        if s.buffer:  # asynchronous rounds: how full the open buffer is
            phase += f", buffer {s.buffer.get('filled')}/{s.buffer.get('size')}, {s.buffer.get('in_flight')} training"
        online = ("-" if s.state == "offline" else f"{s.agents_online} as it stopped" if s.state in ENDED
                  else s.agents_online)  # the last will says 0: the count the server had is not known  # fmt: skip
        head.add_row(*cells(s.state, s.round, phase, strategy, model, shown, online),
                     *cells(s.detail, limit=MAX_CELL))  # fmt: skip
    return head


def _agents_table(view: FederationView) -> Table:
    """One row per agent (at a root: per region), as it claims, with what the last round made of it."""
    agents = _table("agents (at a root: regions), as each claims: the monitor checks no signatures",
                    "agent", "state", "round", "done", "samples", "model", "gate", "age s", "last round",
                    "own score")  # fmt: skip
    agents.add_column("detail", overflow="fold", ratio=1, min_width=30)
    last = view.metrics[-1] if view.metrics else None
    now = time.time()
    for name, a in sorted(view.agents.items())[:MAX_ROWS]:
        state = f"{a.state} (from {a.start})" if a.start not in ("", "global") else a.state
        state += f" ({view.notes[name]})" if name in view.notes else ""
        agents.add_row(
            *cells(name),
            *cells(state, limit=MAX_CELL),
            *cells(a.round, a.last_completed_round, a.samples, f"v{a.version}"),
            *cells(gate_text(a.gate.ok, a.gate.reasons), limit=MAX_CELL),
            *cells(number(now - a.updated_at, digits=0), *_last_round(last, name)),
            *cells(a.detail, limit=MAX_CELL),
        )
    return agents


def _last_round(m: RoundMetrics | None, agent: str) -> tuple[str, str]:
    """What the newest round made of ``agent``, and its own score there (``aggregation.local_eval``: an agent's
    validation split; a region's aggregate as the region's server scored it)."""
    if m is None:
        return "-", "-"
    listed = m.aggregation.get("folded_late")  # late updates of the round before folded into this one (flcore.late)
    folded = [str(k).rpartition("@")[2] for k in listed if str(k).rpartition("@")[0] == agent] \
        if isinstance(listed, list) else []
    if agent not in m.participants and not folded:
        return "-", "-"
    own = m.aggregation.get("local_eval")
    own = own.get(agent) if isinstance(own, dict) else None
    shown = _lead(global_scores(own)) if isinstance(own, dict) else "-"
    late = f", its round {folded[0]} folded in late" if folded else ""
    refused = next((r.reason for r in m.rejected if r.agent == agent), None)
    if refused is not None:
        return f"{m.round}: rejected ({refused}){late}", shown
    if agent in m.accepted:
        return f"{m.round}: accepted{late}", shown
    if agent not in m.participants:
        return f"{m.round}: round {folded[0]}'s update folded in late", shown
    return f"{m.round}: {'missed' if agent in m.missed else 'no update'}{late}", shown


def _agent_notes(view: FederationView) -> list[Text]:
    notes = _more(len(view.agents), "agents")
    s = view.server
    claimed = sum(a.state != "offline" for a in view.agents.values())
    if s is not None and s.state not in ("offline", *ENDED) and claimed != s.agents_online:  # it still counts
        notes.append(Text(f"the server counts {s.agents_online} agents online; {claimed} statuses here claim to be "
                          "(the server checks signatures, replays and freshness: a row may show a claim it "
                          "refused, or an agent it has not heard from lately)"))  # fmt: skip
    return notes


def _more(count: int, what: str) -> list[Text]:
    shown = f"{count - MAX_ROWS} more {what} not shown (the first {MAX_ROWS} by name)"
    return [Text(shown)] if count > MAX_ROWS else []


def _rounds_table(metrics: list[RoundMetrics], past: PastRounds) -> Table:
    """The newest round's headline labels lead the columns (C-SPE for kept models, accuracy or mAP@.5 for a
    global model); labels only older rounds had follow, as room allows. Rounds that ended before the monitor
    started come from the server's retained history (``past``), with the counts it keeps."""
    first, room = (metrics[0].round if metrics else None), ROUNDS_KEPT - len(metrics)
    earlier = [r for r in past.rows if first is None or r["round"] < first][-room:] if room > 0 else []
    named = [[{"label": past.labels.get(key, key), "value": value} for key, value in r["headline"]] for r in earlier]
    labels = list(dict.fromkeys(s["label"] for scores in [*(m.headline for m in reversed(metrics)), *reversed(named)]
                                for s in scores))[:SCORE_COLUMNS]  # fmt: skip
    rounds = _table("rounds", "round", "accepted", "rejected", *labels, "seconds", "MB up", "MB down")
    for r, scores in zip(earlier, named, strict=True):
        by_label = {s["label"]: score(s["value"]) for s in scores}
        outcome = "" if r["outcome"] == "committed" else f" ({r['outcome']})"
        rounds.add_row(
            *cells(f"{r['round']}{outcome} (history)", limit=MAX_CELL),
            *cells(r.get("accepted", "-"), r.get("rejected", "-")),
            *cells(*(by_label.get(label, "-") for label in labels)),
            *cells("-", *(number(r[k], 1e6, 2) if type(r.get(k)) in (int, float) else "-" for k in ("bytes_up",
                                                                                                     "bytes_down"))),
        )  # fmt: skip
    for m in metrics:
        outcome = "" if m.outcome == "committed" else f" ({m.outcome}: {m.reason})"
        outcome += "" if m.action == "average" else f" {m.action}"
        outcome += "".join(f"; {text}" for text in (buffer_text(m.buffer), wasted_text(m.wasted)) if text)
        by_label = {s["label"]: score(s["value"]) for s in m.headline}
        rounds.add_row(
            *cells(f"{m.round}{outcome}", limit=MAX_CELL),
            *cells(f"{len(m.accepted)}/{len(m.participants)}", len(m.rejected)),
            *cells(*(by_label.get(label, "-") for label in labels)),
            *cells(number(m.duration_s), number(m.bytes_up, 1e6, 2), number(m.bytes_down, 1e6, 2)),
        )
    return rounds


def _groups(m: RoundMetrics) -> list[Text]:
    """DemLearn's groups of the newest round (``aggregation.groups``), one line each, as plain text."""
    groups = m.aggregation.get("groups")
    if not isinstance(groups, list) or not groups:
        return []
    lines = [f"groups after round {m.round} (level, group: members, G-GEN on the server's set):"]
    for g in groups[:MAX_GROUPS]:
        if not isinstance(g, dict):
            continue
        members = g.get("members") if isinstance(g.get("members"), list) else []
        names = ", ".join(map(str, members[:MAX_MEMBERS])) + (f" +{len(members) - MAX_MEMBERS}" if
                                                                len(members) > MAX_MEMBERS else "")  # fmt: skip
        lines.append(f"  level {g.get('level')}, group {g.get('group')}: {names or '-'}; G-GEN {score(g.get('g_gen'))}")
    if len(groups) > MAX_GROUPS:
        lines.append(f"  {len(groups) - MAX_GROUPS} more groups")
    return cells(*lines, limit=MAX_CELL)


def _peers_table(view: FederationView) -> Table:
    """One row per peer, as it claims: membership, its last round (led by its headline), its BestAgg claim and
    the model it adopted. The claim of the model most peers adopted is marked with their count; before any
    peer decided, the highest claim peers count is."""
    rows = sorted(view.peers.items())[:MAX_ROWS]
    leads = {p: global_scores(s.metrics.eval) if s.metrics else [] for p, s in rows}
    labels = {scores[0]["label"] for scores in leads.values() if scores}
    label = labels.pop() if len(labels) == 1 else "score"
    peers = _table("peers, as each claims: the monitor checks no signatures", "peer", "state", "round",
                   "last round", label, "trained C-SPE", "aggregated from", "rejected", "best claim",
                   "adopted")  # fmt: skip
    top, chosen = _highest_claim(view.peers), elected(view.peers)
    for name, s in rows:
        lead = leads[name]
        shown = score(lead[0]["value"]) if lead and label != "score" else _lead(lead)
        state = (member_text(s.member) if s.member else "-") + (f" ({s.note})" if s.note else "")
        peers.add_row(*cells(name), *cells(state, limit=MAX_CELL), *cells(s.member.round if s.member else "-"),
                      *cells(_peer_round(s), limit=MAX_CELL),
                      *cells(shown, _trained_c_spe(s), *_peer_counts(s)),
                      *cells(_claim(s, top, chosen), limit=MAX_CELL),
                      *cells(adopted_text(s.decision) if s.decision else "-", limit=MAX_CELL))  # fmt: skip
    return peers


def _peer_round(s: PeerState) -> str:
    m = s.metrics
    if m is None:
        return "-"
    return f"{m.round}" + ("" if m.outcome == "aggregated" else f" ({m.outcome}: {m.reason})")


def _trained_c_spe(s: PeerState) -> str:
    """The mean C-SPE the round's senders reported of the models they trained (the seeds' metric), or -."""
    return score(personal_score(s.metrics.personal, "trained_c_spe")) if s.metrics else "-"


def _peer_counts(s: PeerState) -> tuple[str, str]:
    if s.metrics is None:
        return "-", "-"
    late = s.metrics.aggregation.get("folded_late")  # late updates of the round before (flcore.late)
    late_text = f" + {len(late)} late" if isinstance(late, list) and late else ""
    return f"{len(s.metrics.aggregated_from)}{late_text}", str(len(s.metrics.rejected))


def _highest_claim(peers: dict[str, PeerState]) -> str | None:
    claims = {p: s.best.score for p, s in peers.items() if s.best is not None and s.counted}
    return max(sorted(claims), key=lambda p: claims[p]) if claims else None


def _claim(s: PeerState, top: str | None, chosen: Elected | None) -> str:
    if s.best is None:
        return "-"
    claimed = f"{score(s.best.score)} ({s.best.sha256[:12]})"
    if chosen is not None:  # decided: the mark follows what the peers adopted, not the claims
        return claimed + (_elected_mark(chosen) if chosen.owner == s.best.peer else "")
    if not s.counted:  # peers pass it over: the monitor does not mark it highest either
        why = "of an earlier membership" if s.member and s.member.session != s.best.session else "not a member now"
        return f"{claimed} (not counted: {why})"
    return claimed + (" ◀ highest claim" if top == s.best.peer else "")


def _elected_mark(chosen: Elected) -> str:
    return f" ◀ elected by {chosen.adopters} of {chosen.decided} peers"


def _peer_notes(view: FederationView) -> list[Text]:
    notes = _more(len(view.peers), "peers")
    chosen = elected(view.peers)
    if chosen is not None:
        notes += cells(f"elected: {chosen.owner}'s model ({chosen.sha256[:12]}), adopted by {chosen.adopters} of the "
                       f"{chosen.decided} peers that published their decision (each peer's own claim)",
                       limit=MAX_CELL)  # fmt: skip
    elif any(s.best is not None for s in view.peers.values()):
        notes.append(Text("no peer has published its decision yet: each adopts the highest claim only if its own "
                          "validation split agrees (federation.best_margin), else the next"))  # fmt: skip
    return notes
