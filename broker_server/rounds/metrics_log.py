"""``metrics.jsonl``: one JSON object per finished round, appended durably, never duplicated or lost.

The checkpoint carries the last round's metrics; after a crash between checkpoint and append,
``reconcile`` appends the line the file is missing, so every committed or rolled-back round appears
exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from broker_server.rounds.pipeline import RoundContext
from common.files import fsync_folder
from flcore.rounds import RoundState
from participant.recipes import work_share
from protocol.messages import Rejection, RoundMetrics, TrainSettings, headline

log = logging.getLogger("skyfed.server")


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, metrics: RoundMetrics) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as handle:
            handle.write(metrics.to_json() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())

    def set_aside(self) -> Path | None:
        """A new run in a state folder that holds an earlier run's lines (its checkpoint removed): they
        move to ``metrics-<their last write, UTC>.jsonl``, so that ``metrics.jsonl``, ``skyfed report`` and the
        retained history are this run's alone (its rounds count from 1 again, and a line of the earlier run's
        round 1 would have stood for this run's). Returns the new name, or None when there was nothing to keep."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.path.stat().st_mtime))
        kept, n = self.path.with_name(f"metrics-{stamp}.jsonl"), 1
        while kept.exists():  # two runs set aside within a second
            kept, n = self.path.with_name(f"metrics-{stamp}-{n}.jsonl"), n + 1
        os.replace(self.path, kept)
        fsync_folder(self.path.parent)  # before the new run's checkpoint: a power loss must not bring the file back
        return kept

    def last_round(self) -> int | None:
        if not self.path.exists():
            return None
        lines = self.path.read_bytes().splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line)["round"])
            except (ValueError, KeyError, TypeError):
                continue
        return None

    def reconcile(self, last: dict | None) -> None:
        """Append the checkpoint's last metrics if the file does not end with that round."""
        if last is None:
            return
        metrics = RoundMetrics.from_dict(last)
        if self.last_round() != metrics.round:
            self.append(metrics)


def round_metrics(
    ctx: RoundContext,
    *,
    strategy: str,
    models: str,
    now: float,
    outcome: tuple[str, str, list[str]],
    version: int,
    run_id: str,
    bytes_down: int,
    personal: dict | None = None,
    buffer: dict | None = None,
) -> RoundMetrics:
    """A closed round's metrics line; ``outcome`` is (committed | rolled-back, reason, offenders)."""
    rs = ctx.state
    aggregation = {**ctx.aggregation_detail(), **per_agent_detail(rs)}
    committed = outcome[0] == "committed"
    if not committed and ctx.evaluation:
        aggregation["rejected_eval"] = ctx.evaluation
    return RoundMetrics(
        round=rs.round,
        strategy=strategy,
        models=models,
        participants=rs.selected,
        accepted=rs.accepted,
        rejected=[Rejection.from_dict(r) for r in rs.rejected],
        duration_s=round(now - rs.started_at, 3),
        aggregate_s=round(ctx.aggregate_s, 6),
        bytes_up=rs.bytes_up,
        bytes_down=bytes_down,
        eval=ctx.evaluation if committed else {},
        model_version=version,
        finished_at=now,
        outcome=outcome[0],
        reason=outcome[1],
        offenders=outcome[2],
        aggregation=aggregation,
        missed=rs.missed,
        action=rs.action,
        personal=personal or {},
        wasted={kind: len(agents) for kind, agents in rs.wasted.items()},
        buffer=buffer or {},
        run_id=run_id,
    )


def log_round(m: RoundMetrics) -> None:
    """One journal line per closed round."""
    log.info(
        "round closed round=%d outcome=%s accepted=%d/%d rejected=%d score=%s loss=%s aggregate_ms=%.2f "
        "version=%d clipped=%s%s%s%s",
        m.round,
        m.outcome,
        len(m.accepted),
        len(m.participants),
        len(m.rejected),
        headline(m.eval),
        m.eval.get("loss"),
        m.aggregate_s * 1e3,
        m.model_version,
        ",".join(m.aggregation.get("clipped", [])) or "-",
        f" by={m.aggregation['chose']}" if "chose" in m.aggregation else "",
        f" screened={','.join(m.aggregation['screened'])}" if m.aggregation.get("screened") else "",
        _clusters(m.aggregation.get("clusters")),
    )
    if m.aggregation.get("decided"):
        chose, why = m.aggregation["chose"], m.aggregation["why"]
        log.info("aggregation auto chose %s from round %d on: %s", chose, m.round, why)


def _clusters(clusters: list[list[str]] | None) -> str:
    """FedAMN's clusters for the next round: how many, the largest, and how many agents are alone in theirs
    (they train on without anyone's model: outliers, honest or not)."""
    if not clusters:
        return ""
    return f" clusters={len(clusters)} largest={max(map(len, clusters))} alone={sum(len(c) == 1 for c in clusters)}"


def log_run_finished(*, rounds: int, version: int, evaluation: dict, best: dict, out: Path, why: str) -> None:
    """The one line that says the run is over, what came out of it and where it is."""
    score = headline(evaluation)
    log.info(
        "run finished rounds=%d final model version=%d eval=%s best=%s out=%s reason=%s",
        rounds,
        version,
        "none (server.eval_data is not set)" if score is None and not evaluation else score,
        f"v{best['version']}" if best.get("version") else "-",
        out,
        why,
    )


def per_agent_detail(state: RoundState) -> dict[str, dict[str, float]]:
    """What differs per agent in a round, for its metrics: the share of work each was asked for (e.g.
    FedProx's partial work), each agent's own local-DP epsilon and its own validation metrics."""
    detail: dict[str, dict[str, float]] = {}
    if state.agent_train:
        detail["work"] = {a: work_share(TrainSettings.from_dict(train)) for a, train in state.agent_train.items()}
    local = {u.agent: u.local_epsilon for u in state.on_time if u.local_epsilon is not None}
    if local:
        detail["local_epsilon"] = local
    local_eval = {u.agent: u.local_eval for u in state.on_time if u.local_eval}
    if local_eval:
        detail["local_eval"] = local_eval
    return detail
