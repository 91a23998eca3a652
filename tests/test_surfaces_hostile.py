"""The operator's surfaces (``skyfed monitor``, ``skyfed report``, the sim's console lines, the Prometheus headline)
against what an enrolled agent, a peer or a region gone rogue can publish or get written: numbers no float holds,
claims under another's name, replays the server or the peers refuse, markup and floods."""

from __future__ import annotations

import io
import json
import time

import pytest
from rich.console import Console

from broker_server.watch.monitor import monitor
from broker_server.watch.monitor_tables import render
from broker_server.watch.monitor_view import FederationView
from broker_server.watch.prometheus import ServerMetrics
from flcore.update import FORMAT, UpdateMeta, UpdateMetaError
from protocol.messages import AgentStatus, RoundMetrics, ServerStatus
from protocol.mqtt import BrokerSettings
from protocol.peer_messages import Adoption, PeerBest, PeerMember, PeerRoundMetrics
from protocol.prometheus import MetricsSection
from protocol.scores import row_headline
from protocol.topics import Topics
from security.keys import Identity
from security.signing import signed_payload
from sim.plot_agents import MAX_GRID, agent_grid, draw_agents
from sim.plot_peers import ElectedModel, draw_peer_curves, peer_grid
from sim.report import write_report
from sim.report_rows import read_rows
from sim.run import format_round
from tests.fedharness import round_metrics
from tests.fixtures import election_rows, peer_rows, round_row, write_run
from tests.liveharness import retain_all

HUGE = 10**400  # JSON allows it (4,300 digits at most); no float holds it


def _render(view: FederationView) -> str:
    console = Console(record=True, width=220)  # the peers table has ten columns
    console.print(render(view))
    return console.export_text()


def _signed(message: object, name: str) -> bytes:
    body = message if isinstance(message, dict) else message.to_dict()
    return signed_payload(body, Identity.generate(name))  # the monitor checks no signature


def _server_status(federation: str = "fleet", **fields: object) -> bytes:
    status = ServerStatus(state="running", federation=federation, round=3, phase="training", strategy="fedavg",
                          model_version=2, agents_online=1, updated_at=time.time()).to_dict()  # fmt: skip
    return json.dumps({**status, **fields}).encode()


def _metrics(**fields: object) -> bytes:
    return json.dumps({**json.loads(round_metrics(round=4, participants=["d1"], accepted=["d1"]).to_json()),
                       **fields}).encode()  # fmt: skip


def test_an_integer_no_float_holds_is_no_score_on_any_monitor_row(broker):
    """A region's own score (``local_eval``), a server status', a round's, a DemLearn group's or a peer's: an
    integer of 400 digits crashed the monitor (OverflowError) wherever it was turned into a float."""
    status = AgentStatus(agent="d1", state="ready", round=4, samples=5, version=3, updated_at=time.time())
    peer = PeerRoundMetrics("p0", 4, "aggregated", {}, []).to_dict() | {"eval": {"accuracy": HUGE, "loss": 0.5}}
    retain_all(broker, {"skyfed/fleet/server/status": _server_status(eval={"accuracy": HUGE}),
                        "skyfed/fleet/agent/d1/status": _signed(status, "d1"),
                        "skyfed/fleet/peer/p0/metrics": _signed(peer, "p0")})  # fmt: skip
    out = io.StringIO()
    settings = BrokerSettings(broker.host, broker.port, protocol="5")
    assert monitor(settings, "fleet", once=True, timeout_s=0.5, console=Console(file=out, width=200)) == 0
    rows = {line.split("│")[1].strip(): line for line in out.getvalue().splitlines() if line.startswith("│ ")}
    assert rows["running"].split("│")[6].strip() == "-"  # the server's score column
    assert "loss" in out.getvalue() and "0.5000" in rows["p0"]

    view = FederationView(Topics("fleet"))
    view.apply("skyfed/fleet/agent/d1/status", _signed(status, "d1"))
    line = view.apply("skyfed/fleet/server/metrics", _metrics(
        models="group", eval={"accuracy": HUGE, "loss": 0.25}, personal={"c_spe": HUGE, "c_gen": 0.5},
        aggregation={"local_eval": {"d1": {"accuracy": HUGE}}, "groups": [{"level": 1, "group": "0", "g_gen": HUGE,
                                                                           "members": ["d1"]}]}))  # fmt: skip
    assert line is not None and "c_gen=0.5000" in line and "accuracy=" not in line and "metric=(too large)" in line
    shown = _render(view)
    assert "G-GEN (too large)" in shown and "C-SPE" not in shown and "global loss" in shown
    assert view.metrics[0].headline == [{"key": "c_gen", "label": "C-GEN", "value": 0.5},
                                        {"key": "loss", "label": "global loss", "value": 0.25}]  # fmt: skip


def test_an_integer_no_float_holds_is_a_gap_in_the_report(tmp_path):
    row = {"round": 2, "accepted": ["a"], "eval": {"accuracy": HUGE, "loss": 1.0}, "personal": {"c_spe": HUGE}}
    assert [s["key"] for s in row_headline(row)] == ["loss"]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 1, "accepted": ["a"], "eval": {"accuracy": 0.5}})
                                            + "\n" + json.dumps(row) + "\n")  # fmt: skip
    said: list[str] = []
    assert [p.name for p in write_report(tmp_path, said.append)] == ["curves.png", "agents.png"]
    assert RoundMetrics.from_json(_metrics(eval={"accuracy": HUGE})).headline == []


def test_a_report_skips_a_line_nested_too_deep_and_draws_a_forged_election_as_plain_text(tmp_path):
    """A line or an ``election.json`` of 100,000 ``[`` raised RecursionError; a sha256 with mathtext in it made
    matplotlib fail to draw the title."""
    server, peer, nested = tmp_path / "server", tmp_path / "peer", "[" * 100_000
    write_run(server, [round_row(1, eval={"accuracy": 0.5})])
    with open(server / "metrics.jsonl", "a") as handle:
        handle.write(nested + "\n")
    said: list[str] = []
    assert [p.name for p in write_report(server, said.append)] == ["curves.png", "agents.png"]
    assert any("skipped 1 line(s)" in line for line in said)
    write_run(peer, peer_rows(3, 2), election=election_rows(["peer-1", "peer-2"], "peer-1", sha="$\\frac{$" + "a" * 60))
    assert draw_peer_curves(read_rows(peer / "metrics.jsonl"),
                            ElectedModel.read(peer / "election.json", [])).get_suptitle().startswith(
        "★ elected: peer-1's model (\\$\\frac{\\$aaaa)")  # fmt: skip
    assert [p.name for p in write_report(peer, said.append)] == ["curves.png", "agents.png"]
    (peer / "election.json").write_text(nested)
    assert ElectedModel.read(peer / "election.json", []).sha is None


def _row(shown: str, name: str) -> list[str]:
    line = next(line for line in shown.splitlines() if line.startswith(f"│ {name} "))
    return [cell.strip() for cell in line.split("│")[1:-1]]


def test_a_status_the_server_refuses_is_not_shown_as_the_agents_claim():
    """Signed for another agent (status-mismatch), an older status replayed (status-older), another federation's
    server status (a region's under its root's name): the server ignores each, and so does the monitor."""
    view = FederationView(Topics("fleet"))
    live = AgentStatus(agent="d1", state="ready", round=5, samples=9, version=4, updated_at=200.0, session=150.0)
    old = AgentStatus(agent="d1", state="training", round=2, samples=9, version=1, updated_at=100.0, session=50.0)
    view.apply("skyfed/fleet/agent/d1/status", _signed(live, "d1"))
    assert view.apply("skyfed/fleet/agent/d2/status", _signed(live, "d1")) is None  # d1's status on d2's topic
    line = view.apply("skyfed/fleet/agent/d1/status", _signed(old, "d1"))
    assert line is not None and "state=training (a replayed older status ignored, as the server does)" in line
    shown = _render(view)
    assert "│ d2 " not in shown and _row(shown, "d1")[2] == "5"
    assert _row(shown, "d1")[1].startswith("ready (a replayed older status ignored")
    view.apply("skyfed/fleet/agent/d1/status", _signed(live, "d1"))  # the same one again (retained, then live)
    assert _row(_render(view), "d1")[1] == "ready"
    view.apply("skyfed/fleet/server/status", _server_status(agents_online=1))
    assert view.apply("skyfed/fleet/server/status", _server_status("region-1", agents_online=7, round=99)) is None
    assert view.server is not None and view.server.round == 3 and view.server.agents_online == 1


def _member(peer: str, state: str, session: float, federation: str = "p2p") -> bytes:
    return _signed(PeerMember(federation, peer, state, 3, session, session), peer)


def _best(peer: str, score: float, session: float, federation: str = "p2p", adopted: Adoption | None = None) -> bytes:
    return _signed(PeerBest(federation, peer, 3, score, "cd" * 32, session, adopted or Adoption()), peer)


def test_peer_claims_the_peers_refuse_are_not_shown_as_in_force():
    """A ``left`` of an earlier connection replayed, a membership or claim signed for another federation, and a
    best claim of an earlier membership (retained from an earlier run) or of a peer that left: peers pass each
    over (agent.peer.roster, agent.peer.election), so no such claim is marked the highest; nor does a decision
    of an earlier run count as one this run's peers made."""
    view = FederationView(Topics("p2p"))
    old = Adoption("cd" * 32, "p1", 0.99)  # p1's decision at the end of its earlier run
    for leaf, payload in (("member", _member("p0", "member", 200.0)), ("best", _best("p0", 0.7, 200.0)),
                          ("member", _member("p1", "member", 300.0)), ("best", _best("p1", 0.99, 100.0, "p2p", old)),
                          ("member", _member("p2", "left", 50.0)), ("best", _best("p2", 0.98, 50.0)),
                          ("member", _member("p3", "member", 10.0, "other")), ("best", _best("p3", 1.0, 10.0, "x"))):
        peer = json.loads(payload)["body"]["peer"]
        view.apply(f"skyfed/p2p/peer/{peer}/{leaf}", payload)
    line = view.apply("skyfed/p2p/peer/p0/member", _member("p0", "left", 100.0))  # its earlier connection's will
    assert line is not None and "a replayed 'left' of an earlier connection ignored" in line
    shown = _render(view)
    assert "p3" not in shown
    assert _row(shown, "p0")[1].startswith("member (a replayed 'left' of an earlier connection ignored")
    assert _row(shown, "p0")[-2] == "0.7000 (cdcdcdcdcdcd) ◀ highest claim"
    claim, adopted = _row(shown, "p1")[-2:]  # the claim folds onto a second line beside the adopted column
    assert claim.startswith("0.9900 (cdcdcdcdcdcd) (not counted: of an earlier") and adopted == "-"
    assert _row(shown, "p2")[-2] == "0.9800 (cdcdcdcdcdcd) (not counted: not a member now)"
    view.apply("skyfed/p2p/peer/p0/member", _member("p0", "left", 200.0))  # its own connection's will counts
    assert _row(_render(view), "p0")[1] == "left" and "◀" not in _render(view)


def test_a_forged_round_on_the_public_topic_is_one_printable_console_line():
    """Anyone on a sim's broker (anonymous, loopback) can publish a round: a newline in its reason forged a second
    line, an escape reached the terminal, and byte counts no float holds or a ``screened`` that is a number
    crashed the sim's console."""
    forged = [RoundMetrics.from_json(_metrics(reason="x\nround   9  accuracy 1.0000\x1b]52;c;x\x07",
                                              outcome="rolled-back", offenders=["a\nb"])),
              RoundMetrics.from_json(_metrics(bytes_up=HUGE, bytes_down=HUGE, aggregation={"screened": 5},
                                              eval={"accuracy": 0.5}, privacy={"epsilon": "\x1b[2J"}))]  # fmt: skip
    lines = [format_round(m, 1.0) for m in forged]
    assert all(line.isprintable() for line in lines), lines
    assert "x\\nround   9" in lines[0] and "offenders a\\nb" in lines[0] and "\\x1b]52" in lines[0]
    assert "MB up (too large)  MB down (too large)" in lines[1] and "screened" not in lines[1]


def test_the_prometheus_scores_are_the_last_committed_rounds_alone():
    """A score the newest committed round lacks kept its older value under the same name, and a rolled-back round
    (its personal scores; no evaluation) replaced the committed round's: both read as the last committed round's."""
    metrics = ServerMetrics(MetricsSection())  # the registry alone, no endpoint
    value = metrics.registry.get_sample_value
    metrics.round_closed(round_metrics(round=1, eval={"accuracy": 0.9, "loss": 0.3}))
    metrics.round_closed(round_metrics(round=2, eval={"accuracy": 0.8}))
    assert value("skyfed_server_round_score", {"score": "accuracy"}) == 0.8
    assert value("skyfed_server_round_score", {"score": "loss"}) is None
    metrics.round_closed(round_metrics(round=3, models="group", eval={}, personal={"c_spe": 0.99},
                                       outcome="rolled-back", reason="non-finite-model"))  # fmt: skip
    assert value("skyfed_server_headline_score", {"score": "accuracy"}) == 0.8
    assert value("skyfed_server_round_score", {"score": "c_spe"}) is None


def test_an_agents_own_score_no_float_holds_is_a_refused_update_not_an_unexpected_error():
    """Its ``local_eval`` or ``start_eval`` (the monitor's "own score", the server's C-SPE) of 400 digits raised
    OverflowError through the server's accept path: neither refused nor counted against the agent."""
    header = {"format": FORMAT, "round": "1", "base_version": "0", "samples": "5", "loss": "0.5"}
    for key in ("local_eval", "start_eval"):
        with pytest.raises(UpdateMetaError, match="bad-metadata"):
            UpdateMeta.from_metadata({**header, key: json.dumps({"accuracy": HUGE})})


def test_a_report_of_a_new_name_on_every_line_stays_linear_in_memory(tmp_path):
    """20,000 lines each naming a new agent (or a new peer in a new round) made a 20,000 × 20,000 grid: 3.2 GB."""
    lines = 20_000
    agents = [{"round": i, "accepted": [f"a{i}"], "eval": {}, "personal": {}} for i in range(1, lines + 1)]
    names, grid = agent_grid(agents)
    assert grid.shape == (MAX_GRID, lines) and grid.nbytes <= MAX_GRID * lines and names[0] == "a1"
    peers = [{"peer": f"p{i}", "round": i, "mode": "peer", "aggregated_from": ["x"]} for i in range(1, lines + 1)]
    shown, rounds, outcome, counts = peer_grid(peers)
    assert len(shown) == MAX_GRID and outcome.shape == counts.shape == (MAX_GRID, MAX_GRID)
    figure = draw_agents(agents[:2000])
    assert figure.axes[0].get_title() == "Each agent's rounds (1000 more not drawn)"
