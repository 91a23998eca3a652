"""Per-agent models at the server (docs/strategies.md). DemLearn's, FedAMP's and FedAMN's end of round for 100 agents
of a 3.2M-value model, whose models live in the server's model store on disk (1.28 GB).

Targets: the strategies' own memory (numpy allocations, tracemalloc; the models themselves are
memory-mapped files the kernel may drop) stays far under the 1.3 GB that holding every model in RAM
would take — at most 0.4 GB — and the end of round takes at most 2 s. Time is also reported as a ratio to
the floor measured in the same run: one pass that reads every kept model once (a sum in column blocks).
Each strategy runs three times: once traced (tracemalloc, which slows every allocation) for its peak memory,
which also pays what the server imports on first use, once per process (SciPy's BLAS and clustering,
about a second); then timed, writing its new models as new files (``new_files_s``, a server's first two
rounds), then timed again, writing them over the files the server released at the last commit
(``common.spare_files``; ``seconds``, every round from the third on). The n x n Gram matrix of the models
(all three) is n²·d/2 multiply-adds and FedAMP's n personalized mixes n²·d: 32 GFLOP at n = 100,
d = 3.2M, spread over the cores (``flcore.blas.in_parallel``). FedAMP also writes its 100 new models
(1.28 GB) to the model store, as the server does: named at random in its default form, where they leave the
server only dithered in a bundle (``ModelBank.writer``; fingerprinted as they are written until 5 December
2026); the development VM's ext4 takes 1.6–2.6 s to write 1.28 GB durably as new files and 0.5 s over released
ones. What is timed is the strategy alone; the server's keep step before it (each agent's trained model written
and fingerprinted, ``broker_server.rounds.keep_step``) has its own row: what it costs the close when every model
is kept there, and now that each is kept as its update is accepted.
"""

from __future__ import annotations

import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from benchmarks.common import report
from broker_server.rounds.keep_step import KeepAgentModels
from broker_server.rounds.pipeline import RoundContext
from flcore.agent_models import Holding, ModelBank, ModelWriter
from flcore.bounds import InfluencePolicy
from flcore.rounds import RoundState
from flcore.strategies import build_strategy
from flcore.strategies.base import Contribution, KeptModels, column_blocks
from models.weights import TensorSpec, unflatten

AGENTS = 100
PARAMS = 3_200_000
SPEC = (TensorSpec("backbone.weight", "float32", (2_400_000,)), TensorSpec("head.weight", "float32", (800_000,)))
LIMIT_BYTES = 400 << 20
LIMIT_S = 2.0
# FedAMN's clusters from round 1 on. FedAMP's σ at these models' distance scale (σ = αₖ = 67,000; the defaults, σ = 1,
# make every weight but an agent's own 0): an agent's 24 of its kind share half its cloud model, and each of the
# others weighs about e^-99, which is subnormal in float32 (``mixing.float32_weights``)
STRATEGIES = {"demlearn": {}, "fedamp": {"sigma": 67_000.0, "alpha_k": 67_000.0}, "fedamn": {"after": 1}}


def kept_models(bank: ModelBank) -> dict[str, Holding]:
    """Four kinds of agents (so the clustering has something to find), each model written to the bank."""
    rng = np.random.default_rng(0)
    kinds = [rng.standard_normal(PARAMS, dtype=np.float32) for _ in range(4)]
    kept = {}
    for i in range(AGENTS):
        agent = f"agent-{i:03d}"
        vector = kinds[i % 4] + 0.1 * rng.standard_normal(PARAMS, dtype=np.float32)
        kept[agent] = bank.writer(1, agent, SPEC, {}).keep(vector)
    return kept


def views(bank: ModelBank, kept: dict[str, Holding]) -> list[Contribution]:
    return [Contribution(a, bank.vector(h), 1.0, 1.0, 0.0, model=bank.vector(h)) for a, h in kept.items()]


def end_of_round(name: str, bank: ModelBank, kept: dict[str, Holding], traced: bool) -> tuple[float, int, int]:
    """Seconds, peak numpy bytes (``traced`` only: tracing slows every allocation) and models kept for
    ``name``'s aggregate + plan_starts."""
    strategy = build_strategy({"name": name, **STRATEGIES[name]})
    written = []

    def writer(name: str, *, fingerprinted: bool = True) -> ModelWriter:  # as the server keeps a model
        written.append(name)
        return bank.new_models(1, SPEC, {})(name, fingerprinted=fingerprinted)

    models = KeptModels(round=1, action=strategy.action(1), agents=list(kept), kept=kept, exact=set(kept),
                        current={}, spec=SPEC, vector=bank.vector, writer=writer,
                        peers=lambda holdings: bank.peers(holdings, SPEC),
                        rng=lambda: np.random.default_rng(1))  # fmt: skip
    start = np.zeros(PARAMS, np.float32)
    strategy.begin(start, SPEC)
    if traced:
        tracemalloc.start()
    started = time.perf_counter()
    strategy.aggregate(start, views(bank, kept))
    strategy.plan_starts(models)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] if traced else 0
    tracemalloc.stop()
    return seconds, peak, len(written)


def commit(bank: ModelBank, kept: dict[str, Holding], spares: bool) -> None:
    """What the server's commit does to the models written since: released to be written over by the next
    round's (``common.spare_files``); without ``spares``, deleted as well, so the next writes make new files."""
    bank.keep_only(set(kept.values()))
    if not spares:
        bank.keep_only(set(kept.values()))


def read_floor(bank: ModelBank, kept: dict[str, Holding]) -> float:
    started = time.perf_counter()
    total = 0.0
    for _, _, block in column_blocks(views(bank, kept)):
        total += float(block.sum(dtype=np.float64))
    return time.perf_counter() - started


def keep_step(bank: ModelBank, kept: dict[str, Holding], early: bool) -> tuple[float, float]:
    """Seconds the close spends in the server's keep step (``KeepAgentModels``) for every agent's update (a delta
    from a zero start), after keeping each one as it was accepted (``early``) or not; and the seconds those
    acceptances took."""
    step = KeepAgentModels(bank, lambda agent: np.zeros(PARAMS, np.float32), InfluencePolicy(clip="off"))
    state = RoundState(round=2, attempt=1 + early, selected=list(kept), deadline=0.0, started_at=0.0)
    zero = unflatten(np.zeros(PARAMS, np.float32), SPEC)
    contributions = [Contribution(agent, bank.vector(h), 1.0, 1.0, 0.0) for agent, h in kept.items()]
    started = time.perf_counter()
    if early:
        for c in contributions:
            step.keep_accepted(state, c.agent, c.delta, zero, np.zeros(PARAMS, np.float32), SPEC)
    accepting = time.perf_counter() - started
    ctx = RoundContext(state, zero, np.zeros(PARAMS, np.float32), SPEC,
                       open_delta=lambda agent: bank.vector(kept[agent]), contributions=contributions)  # fmt: skip
    started = time.perf_counter()
    step.run(ctx)
    return time.perf_counter() - started, accepting


def main() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="skyfed-kept-") as folder:
        bank = ModelBank(Path(folder))
        kept = kept_models(bank)
        floor = read_floor(bank, kept)
        for name in STRATEGIES:
            _, peak, _ = end_of_round(name, bank, kept, traced=True)  # also pays what a server imports once
            commit(bank, kept, spares=False)
            first, _, _ = end_of_round(name, bank, kept, traced=False)  # new files: a server's first two rounds
            commit(bank, kept, spares=True)
            seconds, _, written = end_of_round(name, bank, kept, traced=False)  # over the last round's files
            commit(bank, kept, spares=True)
            rows.append(report(
                f"kept_models_{name}", target=f"peak numpy memory <= {LIMIT_BYTES >> 20} MB for {AGENTS} agents x "
                f"{PARAMS:,} values (all models in RAM: {AGENTS * PARAMS * 4 >> 20} MB); <= {LIMIT_S:g} s",
                ok=peak <= LIMIT_BYTES and seconds <= LIMIT_S,
                agents=AGENTS, params=PARAMS, seconds=round(seconds, 2), new_files_s=round(first, 2),
                read_once_s=round(floor, 2), ratio_to_read_once=round(seconds / floor, 1),
                peak_mb=round(peak / 2**20, 1), models_written=written,
            ))  # fmt: skip
        keep_step(bank, kept, False)  # new files; the runs timed write over them, as from the third round on
        commit(bank, kept, spares=True)
        at_close, _ = keep_step(bank, kept, False)
        commit(bank, kept, spares=True)
        after_acceptance, accepting = keep_step(bank, kept, True)
        rows.append(report(
            "kept_models_keep_step", ok=True, agents=AGENTS, params=PARAMS,
            target=f"the close's keep step for {AGENTS} agents x {PARAMS:,} values, models kept on acceptance",
            all_at_close_s=round(at_close, 2), kept_on_acceptance_s=round(after_acceptance, 3),
            per_acceptance_ms=round(1000 * accepting / AGENTS, 1),
        ))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
