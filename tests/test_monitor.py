"""``skyfed monitor`` shows whatever anyone publishes on the status topics, and never crashes on it."""

import json

from rich.console import Console

from broker_server.watch.monitor_tables import render
from broker_server.watch.monitor_text import peer_metrics_line
from broker_server.watch.monitor_view import FederationView
from protocol.messages import AgentStatus, Gate, Rejection
from protocol.peer_messages import Adoption, PeerBest, PeerMember, PeerRoundMetrics
from protocol.topics import Topics
from security.keys import Identity
from security.signing import signed_payload
from tests.fedharness import round_metrics


def _render(view: FederationView) -> str:
    console = Console(record=True, width=200)
    console.print(render(view))
    return console.export_text()


def test_markup_in_a_status_is_shown_literally():
    view = FederationView(Topics("fleet"))
    hostile = AgentStatus(
        agent="drone-01", state="[/oops][bold red]pwned", round=1, samples=1, version=1, updated_at=0.0
    )
    signed = signed_payload(hostile.to_dict(), Identity.generate("drone-01"))  # agents sign their status
    view.apply("skyfed/fleet/agent/drone-01/status", signed)
    assert "[/oops][bold red]pwned" in _render(view)


def test_deeply_nested_or_oversized_status_is_ignored():
    view = FederationView(Topics("fleet"))
    for payload in (b"[" * 200_000, b'{"a":' * 40_000 + b"1" + b"}" * 40_000, b"\xff" * 10):
        view.apply("skyfed/fleet/agent/drone-01/status", payload)
        view.apply("skyfed/fleet/server/status", payload)
        view.apply("skyfed/fleet/server/metrics", payload)
    assert view.agents == {} and view.server is None and view.metrics == []
    _render(view)


def test_a_rolled_back_round_is_shown_with_its_reason():
    view = FederationView(Topics("fleet"))
    metrics = round_metrics(round=4, eval={"loss": float("nan")}, outcome="rolled-back", reason="non-finite-evaluation")
    view.apply("skyfed/fleet/server/metrics", metrics.to_json())
    assert json.loads(metrics.to_json())["eval"]["loss"] is None
    assert "rolled-back: non-finite-evaluation" in _render(view)


def _signed(message: object, name: str = "peer") -> bytes:
    return signed_payload(message.to_dict(), Identity.generate(name))  # the monitor checks no signature


def _header(text: str, first: str) -> list[str]:
    """The column names of the table whose header starts with ``first``, in order."""
    line = next(line for line in text.splitlines() if line.startswith(f"┃ {first} "))
    return [cell.strip() for cell in line.strip("┃").split("┃")]


def test_each_kind_of_model_leads_with_its_headline():
    cases = [  # (models, eval, personal) -> the columns after round, accepted, rejected; the line's score keys
        ("global", {"accuracy": 0.9, "loss": 0.3}, {}, ["accuracy", "loss"], ["accuracy", "loss"]),
        ("global", {"map50": 0.4, "map50_95": 0.2}, {}, ["mAP@.5", "mAP@.5:.95"], ["map50", "map50_95"]),
        ("group", {"accuracy": 0.6, "loss": 1.1}, {"c_spe": 0.9, "c_gen": 0.5},
         ["C-SPE", "C-GEN", "global accuracy", "global loss"], ["c_spe", "c_gen", "accuracy", "loss"]),
    ]  # fmt: skip
    for models, evaluation, personal, columns, keys in cases:
        view = FederationView(Topics("fleet"))
        metrics = round_metrics(round=2, models=models, eval=evaluation, personal=personal)
        line = view.apply("skyfed/fleet/server/metrics", metrics.to_json())
        shown = _render(view)
        assert _header(shown, "round")[3 : 3 + len(columns)] == columns, shown
        fields = [f.split("=")[0] for f in line.split()[1:]]
        assert fields[3 : 3 + len(keys)] == keys, line  # after round, outcome, reason
        assert "None" not in shown and "None" not in line
        assert f"{keys[0]}={metrics.headline[0]['value']:.4f}" in line


def test_demlearn_groups_are_listed_as_plain_text():
    groups = [{"level": 1, "group": "0", "members": ["a", "[bold]b"], "g_gen": 0.5},
              {"level": 1, "group": "1", "members": [f"m{i}" for i in range(20)]}, "junk", {"members": 5}]  # fmt: skip
    view = FederationView(Topics("fleet"))
    metrics = round_metrics(round=3, models="group", personal={"c_spe": 0.8}, aggregation={"groups": groups})
    view.apply("skyfed/fleet/server/metrics", metrics.to_json())
    shown = _render(view)
    assert "level 1, group 0: a, [bold]b; G-GEN 0.5000" in shown
    assert "m7 +12; G-GEN -" in shown and "m8" not in shown


def test_a_root_shows_each_region_with_what_its_last_round_made_of_it():
    view = FederationView(Topics("root"))
    for region in ("region-1", "region-2"):
        status = AgentStatus(agent=region, state="training", round=4, samples=0, version=3, updated_at=0.0)
        view.apply(f"skyfed/root/agent/{region}/status", _signed(status, region))
    metrics = round_metrics(round=4, participants=["region-1", "region-2"], accepted=["region-1"],
                            rejected=[Rejection("region-2", "norm-too-large")], eval={"accuracy": 0.9},
                            aggregation={"local_eval": {"region-1": {"accuracy": 0.87, "loss": 0.4}}})  # fmt: skip
    view.apply("skyfed/root/server/metrics", metrics.to_json())
    rows = {line.split("│")[1].strip(): line for line in _render(view).splitlines() if "region-" in line}
    assert "4: accepted" in rows["region-1"] and "accuracy 0.8700" in rows["region-1"]
    assert "4: rejected (norm-too-large)" in rows["region-2"]


def test_an_agent_whose_late_update_was_folded_into_the_next_round_says_so():
    view = FederationView(Topics("root"))
    for agent in ("agent-1", "agent-2"):
        status = AgentStatus(agent=agent, state="training", round=5, samples=0, version=3, updated_at=0.0)
        view.apply(f"skyfed/root/agent/{agent}/status", _signed(status, agent))
    metrics = round_metrics(round=5, participants=["agent-1"], accepted=["agent-1"], eval={"accuracy": 0.9},
                            aggregation={"folded_late": ["agent-2@4", "agent-1@4"]})  # fmt: skip
    view.apply("skyfed/root/server/metrics", metrics.to_json())
    rows = {line.split("│")[1].strip(): line for line in _render(view).splitlines() if "agent-" in line}
    assert "5: round 4's update folded in late" in rows["agent-2"]
    assert "5: accepted, its round 4 folded in late" in rows["agent-1"]


def _peer(view: FederationView, name: str, accuracy: float, *, best: float | None = None,
          adopted: Adoption | None = None, state: str = "member") -> None:
    member = PeerMember("p2p", name, state, 5, 1.0, 1.0)
    metrics = PeerRoundMetrics(name, 4, "aggregated", {"accuracy": accuracy, "loss": 0.5}, ["p0", "p1", "p2"],
                               [{"peer": "px", "reason": "stale-base"}],
                               personal={"c_spe": 0.5, "trained": {"c_spe": round(accuracy + 0.1, 4)}})  # fmt: skip
    for leaf, message in (("member", member), ("metrics", metrics)):
        view.apply(f"skyfed/p2p/peer/{name}/{leaf}", _signed(message, name))
    if best is not None:
        claim = PeerBest("p2p", name, 5, best, name * 32, 1.0, adopted or Adoption())
        view.apply(f"skyfed/p2p/peer/{name}/best", _signed(claim, name))


def _rows(shown: str) -> dict[str, list[str]]:
    return {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in shown.splitlines() if line.startswith("│ p")}  # fmt: skip


def test_peers_each_show_their_round_headline_counts_and_the_highest_claim():
    view = FederationView(Topics("p2p"))
    _peer(view, "p0", 0.81, best=0.8)
    _peer(view, "p1", 0.85, best=0.9)
    forged = PeerRoundMetrics("p0", 99, "aggregated", {"accuracy": 0.01}, [])  # p0's metrics under p1's name
    assert view.apply("skyfed/p2p/peer/p1/metrics", _signed(forged)) is None
    shown = _render(view)
    assert _header(shown, "peer") == ["peer", "state", "round", "last round", "accuracy", "trained C-SPE",
                                      "aggregated from", "rejected", "best claim", "adopted"]  # fmt: skip
    rows = _rows(shown)
    assert rows["p0"] == ["p0", "member", "5", "4", "0.8100", "0.9100", "3", "1", "0.8000 (p0p0p0p0p0p0)", "-"]
    assert rows["p1"][4] == "0.8500" and rows["p1"][8].endswith("◀ highest claim")
    line = peer_metrics_line(view.peers["p0"].metrics)  # the senders' reports after the peer's own model
    assert "accuracy=0.8100 loss=0.5000 c_spe=0.5000 trained_c_spe=0.9100 aggregated_from=3" in line
    assert "SkyFed federation" not in shown  # a peer federation has no server
    assert "no peer has published its decision yet" in shown


def test_the_model_most_peers_adopted_is_marked_with_their_count_each_decision_shown_as_claimed():
    view = FederationView(Topics("p2p"))
    honest = Adoption("p1" * 32, "p1", 0.88)
    for name in ("p0", "p1", "p2"):  # p2 has left since: its decision of that membership still counts
        _peer(view, name, 0.8, best=0.8, adopted=honest, state="left" if name == "p2" else "member")
    _peer(view, "p3", 0.1, best=0.99, adopted=Adoption("p3" * 32, "p3", 0.99))  # a rogue peer adopts its own
    _peer(view, "p4", 0.8, best=0.8)  # not decided yet
    stale = PeerMember("p2p", "p5", "member", 5, 2.0, 2.0)  # p5's decision is of an earlier connection
    view.apply("skyfed/p2p/peer/p5/member", _signed(stale, "p5"))
    earlier = PeerBest("p2p", "p5", 5, 0.5, "p5" * 32, 1.0, Adoption("p5" * 32, "p5", 0.5))
    line = view.apply("skyfed/p2p/peer/p5/best", _signed(earlier, "p5"))
    assert "adopted=p5p5p5p5p5p5p5p5 adopted_from=p5 adopted_score=0.5000" in line
    shown = _render(view)
    rows = _rows(shown)
    assert rows["p1"][8] == "0.8000 (p1p1p1p1p1p1) ◀ elected by 3 of 4 peers", "a liar's claim is not marked"
    assert "◀" not in rows["p3"][8] and rows["p3"][9] == "p3's (p3p3p3p3p3p3), 0.9900 here"
    assert rows["p0"][9] == "p1's (p1p1p1p1p1p1), 0.8800 here" and rows["p4"][9] == rows["p5"][9] == "-"
    assert "elected: p1's model (p1p1p1p1p1p1), adopted by 3 of the 4 peers that published" in shown


def test_hostile_numbers_names_and_floods_stay_bounded():
    view = FederationView(Topics("fleet"))
    huge = 10**4000
    metrics = json.loads(round_metrics(round=7, eval={"accuracy": 1e300}).to_json())
    metrics.update(bytes_up=huge, bytes_down=huge, duration_s=1e308, round=huge,
                   rejected=[{"agent": "x", "reason": "[red]r\x1b[2J" * 500}])  # fmt: skip
    view.apply("skyfed/fleet/server/metrics", json.dumps(metrics).encode())
    for i in range(150):
        name = f"p{i:03d}"
        gate = Gate(ok=False, reasons=["[/x]\x1b]52;c;x\x07"] * 99)
        member = PeerMember("fleet", name, "member", 2**31, 1.0, 1.0, gate)
        view.apply(f"skyfed/fleet/peer/{name}/member", _signed(member, name))
    rogue = {**PeerMember("fleet", "p-huge", "member", 1, 1.0, 1.0).to_dict(), "round": huge}
    view.apply("skyfed/fleet/peer/p-huge/member", signed_payload(rogue, Identity.generate("p-huge")))
    shown = _render(view)
    assert "p-huge" not in shown  # refused, as peers refuse a round past any federation's (it would sort first)
    assert "(too large)" in shown and "1e+300" in shown
    assert "50 more peers not shown" in shown and "p149" not in shown
    assert "\x1b" not in shown and "[/x]" in shown
    assert max(len(line) for line in shown.splitlines()) <= 200


def test_a_replayed_offline_is_shown_as_the_server_treats_it():
    view = FederationView(Topics("fleet"))
    live = AgentStatus(agent="d1", state="ready", round=2, samples=5, version=2, updated_at=200.0, session=150.0)
    view.apply("skyfed/fleet/agent/d1/status", _signed(live, "d1"))
    view.apply("skyfed/fleet/agent/d1/status", _signed(AgentStatus.offline("d1", session=100.0), "d1"))
    row = next(line for line in _render(view).splitlines() if line.startswith("│ d1"))
    assert "ready (a replayed 'offline'" in row
    view.apply("skyfed/fleet/agent/d1/status", _signed(AgentStatus.offline("d1", session=160.0), "d1"))
    row = next(line for line in _render(view).splitlines() if line.startswith("│ d1"))
    assert row.split("│")[2].strip() == "offline"  # a newer connection's will counts


def test_rounds_before_the_monitor_started_come_from_the_retained_history():
    """``server/metrics`` is not retained: a monitor started after a run (or ``--once``) showed no round at all
    while the dashboard read the server's retained ``server/history``; now both do."""
    from broker_server.watch.history import RunHistory

    history = RunHistory("fleet")
    for number, accuracy in ((1, 0.5), (2, 0.75), (3, 0.875)):
        history.add(round_metrics(round=number, eval={"accuracy": accuracy, "loss": 1 - accuracy},
                                  participants=["a", "b"], accepted=["a", "b"], bytes_up=2_500_000))  # fmt: skip
    view = FederationView(Topics("fleet"))
    lines = view.apply("skyfed/fleet/server/history", history.payload())
    assert lines.splitlines()[0] == "history round=1 outcome=committed accuracy=0.5000 loss=0.5000 accepted=2 " \
                                    "rejected=0 mb_up=2.50 mb_down=0.00"  # fmt: skip
    assert [line.split()[1] for line in lines.splitlines()] == ["round=1", "round=2", "round=3"]
    shown = _render(view)
    assert "no round has finished" not in shown and "3 (history)" in shown and "0.8750" in shown
    assert _header(shown, "round")[:5] == ["round", "accepted", "rejected", "accuracy", "loss"]
    live = round_metrics(round=4, eval={"accuracy": 0.9, "loss": 0.1}, participants=["a", "b"], accepted=["a"])
    view.apply("skyfed/fleet/server/metrics", live.to_json())
    history.add(live)
    assert view.apply("skyfed/fleet/server/history", history.payload()) is None  # round 4 was shown live
    rows = [line.split("│")[1].strip() for line in _render(view).splitlines() if line.startswith("│")]
    assert rows[-4:] == ["1 (history)", "2 (history)", "3 (history)", "4"]


def test_a_history_that_is_not_the_servers_is_ignored_and_its_bad_rows_dropped():
    from broker_server.watch.history import MAX_BYTES, SCHEMA

    view = FederationView(Topics("fleet"))
    for payload in (b"[1, 2]", json.dumps({"schema": "other/1", "rounds": []}).encode(),
                    json.dumps({"schema": SCHEMA, "rounds": [{"round": 1, "outcome": "x" * MAX_BYTES}]}).encode(),
                    b"{" * 100_000):  # fmt: skip
        assert view.apply("skyfed/fleet/server/history", payload) is None
    assert view.past.rows == ()
    rows = [{"round": "7", "outcome": "committed"}, {"round": 2, "outcome": None}, {"round": 3.5, "outcome": "c"},
            {"round": 9, "outcome": "[red]x\x1b[2J", "accepted": "\x1b[31m",
             "headline": [["accuracy", "0.9"], ["loss", 0.25], 5, ["round", 0.5], ["[blink]m\x1b[31m", 0.25]]}]
    labels = {"loss": "[/nope]", "accuracy": "[bold red]L\x1b]52;c;x\x07"}  # markup, escapes: never a header
    payload = json.dumps({"schema": SCHEMA, "labels": labels, "rounds": rows}).encode()
    line = view.apply("skyfed/fleet/server/history", payload)  # a score key "round" made _line() raise on main
    assert line == "history round=9 outcome=[red]x\\x1b[2J loss=0.2500 accepted=\\x1b[31m rejected=- mb_up=- mb_down=-"
    shown = _render(view)  # a label "[/nope]" made every render raise rich's MarkupError
    assert "\x1b" not in shown and "9 ([red]x" in shown and "blink" not in shown
    assert _header(shown, "round")[3] == "loss"  # what protocol.scores calls it


def test_a_stopped_servers_count_of_agents_online_is_said_to_be_of_when_it_stopped():
    """After a run the server's retained status still counts the agents it had; the agents' rows say offline."""
    from protocol.messages import ServerStatus

    for state, shown in (("finished", "4 as it stopped"), ("stopped", "4 as it stopped"),
                         ("budget_exhausted", "4 as it stopped"), ("offline", "-"), ("training", "4")):
        view = FederationView(Topics("fleet"))
        status = ServerStatus(state=state, federation="fleet", round=3, phase=state, strategy="fedavg",
                              model_version=4, agents_online=4, updated_at=1.0)  # fmt: skip
        view.apply("skyfed/fleet/server/status", status.to_json())
        row = next(line for line in _render(view).splitlines() if line.startswith(f"│ {state}"))
        assert row.split("│")[7].strip() == shown


def test_a_new_run_under_the_same_federation_name_is_shown_from_its_first_round():
    """A monitor left running while a server starts a new run under the same name (sims sharing a broker and a
    name, a reset state folder): the new run counts its rounds from 1 again. Its history rows were not printed
    (their rounds were below the last run's) and the rounds table mixed both runs. Rounds name their run."""
    from broker_server.watch.history import RunHistory

    view = FederationView(Topics("fleet"))
    for number in (1, 2, 3):
        view.apply("skyfed/fleet/server/metrics", round_metrics(round=number, run_id="a").to_json())
    late = RunHistory("fleet")
    late.add(round_metrics(round=2, run_id="a"))
    assert view.apply("skyfed/fleet/server/history", late.payload()) is None  # the same run's, merely late
    history = RunHistory("fleet")
    history.add(round_metrics(round=1, eval={"accuracy": 0.25, "loss": 0.75}, run_id="b"))
    lines = view.apply("skyfed/fleet/server/history", history.payload())
    assert [line.split()[:2] for line in lines.splitlines()] == [["history", "round=1"]]
    assert view.apply("skyfed/fleet/server/metrics", round_metrics(round=2, run_id="b").to_json())
    rows = [line.split("│")[1].strip() for line in _render(view).splitlines() if line.startswith("│")]
    assert rows[-2:] == ["1 (history)", "2"] and "3" not in rows
    view.apply("skyfed/fleet/server/metrics", round_metrics(round=1, run_id="c").to_json())  # live first, this time
    assert [line.split("│")[1].strip() for line in _render(view).splitlines() if line.startswith("│")][-1:] == ["1"]
    view.apply("skyfed/fleet/server/metrics", round_metrics(round=7, run_id="").to_json())  # a server naming no run
    assert [m.round for m in view.metrics] == [1, 7]


def test_a_time_past_floats_range_does_not_crash_the_monitor():
    """An integer time past float's range raised OverflowError out of ``apply``: a retained history holding one
    crashed every monitor started after it."""
    from broker_server.watch.history import SCHEMA

    view = FederationView(Topics("fleet"))
    huge = b"1" + b"0" * 400
    history = b'{"schema":"' + SCHEMA.encode() + b'","rounds":[{"round":1,"outcome":"committed","finished_at":' + \
        huge + b"}]}"  # fmt: skip
    assert view.apply("skyfed/fleet/server/history", history).startswith("history round=1")
    metrics = round_metrics(round=2).to_json().replace(b'"finished_at":0.0', b'"finished_at":' + huge)
    assert view.apply("skyfed/fleet/server/metrics", metrics) is None  # refused as malformed, no crash
    assert "1 (history)" in _render(view)


def test_a_metrics_payloads_odd_fields_are_shown_as_what_they_are_never_a_crash():
    """``aggregation.folded_late`` as a number made ``len()`` raise out of ``apply`` (a retained peer's metrics
    crashed every monitor started after it), and a buffer count past float's range made the table's ``:.4g``
    raise OverflowError."""
    from protocol.messages import RoundMetrics
    from sim.launch import format_round

    view = FederationView(Topics("fleet"))
    peer = PeerRoundMetrics(peer="p1", round=2, outcome="aggregated", eval={}, aggregated_from=[],
                            aggregation={"folded_late": 1})  # fmt: skip
    assert "folded_late=0" in view.apply("skyfed/fleet/peer/p1/metrics", _signed(peer, "p1"))
    document = json.loads(round_metrics(round=3).to_json())
    document["aggregation"] = {"folded_late": 10**400}
    document["buffer"] = {"size": 3, "updates": 10**400, "staleness_mean": 0.5, "staleness_max": 1}
    payload = json.dumps(document).encode()
    assert "folded_late=0" in view.apply("skyfed/fleet/server/metrics", payload)
    assert "buffer ?/3" in _render(view)
    assert "buffer ?/3" in format_round(RoundMetrics.from_json(payload), 1.0)
