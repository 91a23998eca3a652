"""The round task of an open round: what the selected agents are asked to do, in one place for the
daemon (which signs and publishes it) and the in-process sim (which hands it to the trainers)."""

from __future__ import annotations

from broker_server.agents.publisher import PublishedModel
from broker_server.rounds.engine import RoundEngine
from flcore.agent_models import Assignment
from protocol.messages import AgentStart, AgentTrain, RoundTask, TrainSettings

TASK_GRACE_S = 300.0  # a task stays valid this long past its deadline (clock skew); then agents ignore it


def agent_start(agent: str, assignment: Assignment | None, global_sha256: str, continues: bool) -> AgentStart | None:
    """What ``agent`` starts from (None: the global model, as every task says by default)."""
    if assignment is None:
        return AgentStart(agent, "global", global_sha256, continues=True) if continues else None
    peers = assignment.peers.sha256 if assignment.peers is not None else ""
    return AgentStart(agent, assignment.source, assignment.model.sha256, peers_sha256=peers, continues=continues)


def round_task(
    engine: RoundEngine, published: PublishedModel, *, federation: str, group_key_id: str, now: float
) -> RoundTask:
    """The task for ``engine``'s open round, against the ``published`` global model."""
    rs = engine.round_state
    assert rs is not None
    late = late_agents(engine)
    assignments, continues = engine.assignments, engine.local.continues()
    starts = [agent_start(agent, assignments.get(agent), published.sha256, continues) for agent in rs.selected]
    return RoundTask(
        federation=federation,
        round=rs.round,
        attempt=rs.attempt,
        strategy=engine.strategy.name,
        model=engine.config.server.model,
        num_classes=engine.config.server.num_classes,
        model_version=published.version,
        model_sha256=published.sha256,
        model_chunks=published.chunks,
        group_key_id=group_key_id,
        selected=rs.selected,
        pending=rs.pending,
        deadline=rs.deadline,
        issued_at=now,
        train=TrainSettings.from_dict(rs.train),
        run_id=engine.run_id,
        expires_at=rs.deadline + TASK_GRACE_S,
        action=rs.action,
        starts=[start for start in starts if start is not None],
        agent_train=[AgentTrain(agent, TrainSettings.from_dict(train)) for agent, train in rs.agent_train.items()],
        classes=list(engine.config.server.classes),
        share=engine.config.server.share,
        codec=str(engine.codec),
        revoked=rs.revoked,
        late=late,
        late_rounds=late_rounds(engine),
    )


def late_agents(engine: RoundEngine) -> list[str]:
    """Agents whose update of a closed round is still folded in (``flcore.late``): each one still training it
    finishes and sends it. Synchronous rounds: the round just before; asynchronous ones: any within
    ``rounds.max_staleness`` versions, but for agents that joined the open buffer (they train for it instead)."""
    rs, windows = engine.round_state, engine.late.windows()
    assert rs is not None
    if not windows.folding:
        return []
    folded, async_ = set(rs.folded_late), engine.rules.is_async
    return sorted({a for w in windows.windows if async_ or w.round == rs.round - 1 for a in w.owed
                   if f"{a}@{w.round}" not in folded and not (async_ and a in rs.selected)})


def late_rounds(engine: RoundEngine) -> int:
    """How many rounds back an update in the task's ``late`` list may be from: 1, or in asynchronous rounds back to
    the oldest closed round still owed an update (rolled-back buffers publish no version, so rounds outrun
    versions)."""
    rs = engine.round_state
    assert rs is not None
    owed = [w.round for w in engine.state.late if w.owed]
    return max(1, rs.round - min(owed)) if engine.rules.is_async and owed else 1
