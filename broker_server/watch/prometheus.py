"""The aggregator's Prometheus metrics (``[metrics] prometheus_port``; docs/monitoring.md lists them).

The daemon reports events (an update accepted or refused, a round closed) and each status it publishes;
this module turns them into gauges and counters. All of it runs on the daemon's loop thread; the HTTP
thread only reads (``protocol.prometheus``).
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protocol.messages import RoundMetrics, ServerStatus, headline
from protocol.prometheus import BoundedLabel, MetricsSection, serve

STALENESS_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50)
PHASES = ("starting", "waiting-for-agents", "training", "waiting-for-root", "finished")


class ServerMetrics:
    def __init__(self, section: MetricsSection) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.round = Gauge("skyfed_server_round", "The current round (the last one closed between rounds)", registry=r)
        self.phase = Gauge("skyfed_server_phase", "1 for the phase the server is in, 0 for the others", ["phase"],
                           registry=r)  # fmt: skip
        self.participants = Gauge("skyfed_server_participants", "Agents selected for the open round (0 between "
                                  "rounds)", registry=r)  # fmt: skip
        self.agents_online = Gauge("skyfed_server_agents_online", "Agents whose last status is recent and not "
                                   "offline", registry=r)  # fmt: skip
        self.accepted = Counter("skyfed_server_updates_accepted", "Updates accepted into a round", registry=r)
        self.rejected = Counter("skyfed_server_updates_rejected", "Updates and transfers refused, by the refusal's "
                                "kind", ["reason"], registry=r)  # fmt: skip
        self.screened = Counter("skyfed_server_updates_screened", "Accepted updates left out of a small round's "
                                "aggregate for raising the validation loss", registry=r)  # fmt: skip
        self.rounds = Counter("skyfed_server_rounds", "Rounds closed, by outcome (committed or rolled-back)",
                              ["outcome"], registry=r)  # fmt: skip
        self.duration = Gauge("skyfed_server_round_duration_seconds", "How long the last closed round took",
                              registry=r)  # fmt: skip
        self.bytes_up = Counter("skyfed_server_upload_bytes", "Update bytes agents sent up in closed rounds",
                                registry=r)  # fmt: skip
        self.bytes_down = Counter("skyfed_server_download_bytes", "Model bytes sent down to agents in closed rounds",
                                  registry=r)  # fmt: skip
        self.eval_score = Gauge("skyfed_server_eval_score", "The model in force's evaluation: accuracy, or mAP@.5 "
                                "for detectors (NaN without server.eval_data)", registry=r)  # fmt: skip
        self.round_score = Gauge("skyfed_server_round_score", "The last committed round's scores by name (c_spe, "
                                 "c_gen, accuracy, loss, map50, …)", ["score"], registry=r)  # fmt: skip
        self.headline = Gauge("skyfed_server_headline_score", "The score the run is judged by, from the last "
                              "committed round: C-SPE for per-group and per-agent models, else the global model's",
                              ["score"], registry=r)  # fmt: skip
        self.epsilon = Gauge("skyfed_server_epsilon", "Differential privacy spent so far by the worst agent (+Inf "
                             "without [privacy] or once a model went out without noise)", registry=r)  # fmt: skip
        self.version = Gauge("skyfed_server_model_version", "The global model version in force", registry=r)
        self.buffer_size = Gauge("skyfed_server_buffer_size", "Asynchronous rounds: updates per model version "
                                 "(rounds.buffer; 0 for synchronous rounds)", registry=r)  # fmt: skip
        self.buffer_filled = Gauge("skyfed_server_buffer_filled", "Asynchronous rounds: updates in the open buffer",
                                   registry=r)  # fmt: skip
        self.in_flight = Gauge("skyfed_server_agents_in_flight", "Asynchronous rounds: agents training on the "
                               "server's word (the open buffer's and older ones' within rounds.max_staleness)",
                               registry=r)  # fmt: skip
        self.staleness = Histogram("skyfed_server_update_staleness", "Model versions between the one an update was "
                                   "trained from and the one it was folded into", buckets=STALENESS_BUCKETS,
                                   registry=r)  # fmt: skip
        self.wasted = Counter("skyfed_server_updates_wasted", "Trained updates refused for their timing, by kind: "
                              "late (its round closed), stale (beyond rounds.max_staleness) or one-per-buffer",
                              ["kind"], registry=r)  # fmt: skip
        for outcome in ("committed", "rolled-back"):
            self.rounds.labels(outcome=outcome)  # both series exist from the start, at 0
        self.eval_score.set(math.nan)
        self.epsilon.set(math.inf)
        self._reasons = BoundedLabel()
        self.endpoint = serve(section, self.registry)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()

    def update_accepted(self) -> None:
        self.accepted.inc()

    def update_rejected(self, kind: str) -> None:
        self.rejected.labels(reason=self._reasons(kind)).inc()

    def round_closed(self, metrics: RoundMetrics) -> None:
        self.rounds.labels(outcome=metrics.outcome).inc()
        self.screened.inc(len(metrics.aggregation.get("screened", {})))
        self.duration.set(metrics.duration_s)
        self.bytes_up.inc(metrics.bytes_up)
        self.bytes_down.inc(metrics.bytes_down)
        for kind, count in metrics.wasted.items():
            self.wasted.labels(kind=self._reasons(kind)).inc(count)
        for staleness, count in metrics.buffer.get("staleness", {}).items():
            for _ in range(count):
                self.staleness.observe(int(staleness))
        if metrics.outcome == "committed" and metrics.headline:  # the series say this round's scores, no older one's
            self.round_score.clear()
            for score in metrics.headline:
                self.round_score.labels(score=score["key"]).set(score["value"])
            self.headline.clear()  # one series: the lead
            self.headline.labels(score=metrics.headline[0]["key"]).set(metrics.headline[0]["value"])

    def status(self, status: ServerStatus, participants: int) -> None:
        """What the server just reported in ``server/status``, and how many agents its open round selected."""
        self.round.set(status.round)
        for phase in {*PHASES, status.phase}:
            self.phase.labels(phase=phase).set(phase == status.phase)
        self.participants.set(participants)
        self.version.set(status.model_version)
        self.buffer_size.set(status.buffer.get("size", 0))
        self.buffer_filled.set(status.buffer.get("filled", 0))
        self.in_flight.set(status.buffer.get("in_flight", 0))
        self.agents_online.set(status.agents_online)
        score = headline(status.eval)
        self.eval_score.set(math.nan if score is None else score)
        if status.privacy:
            epsilon = status.privacy.get("epsilon")
            self.epsilon.set(math.inf if epsilon is None else epsilon)
