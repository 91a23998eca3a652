"""The dashboard page in a real headless Chromium, against a real federation over mosquitto's WebSockets listener.

Needs Debian's ``chromium`` and ``chromium-driver`` (.ci/run installs them) and selenium; skipped without them.
Selenium is pointed at the system browser and driver, so selenium-manager never downloads anything.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from broker_server.watch.dashboard.server import DashboardServer, PageConfig
from protocol.messages import AgentStatus, Gate, Rejection, RoundMetrics, ServerStatus
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.peer_messages import Adoption, PeerBest, PeerMember, PeerRoundMetrics
from protocol.topics import Topics
from security.keys import Identity
from security.signing import signed_payload
from sim.broker import free_port, start_broker
from tests.fedharness import Federation, round_metrics, wait_until
from tests.wsharness import documented_lab_listener

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
                       reason="headless Chromium tests need apt-get install chromium chromium-driver"),  # fmt: skip
]
UPDATE_TOPICS = ("/model/", "/update", "/inbox", "/round")


@pytest.fixture
def ws_broker(tmp_path):
    """mosquitto with a second, WebSockets listener on a free loopback port (``ws_port``), as docs/dashboard.md says."""
    ws_port = free_port()
    instance = start_broker(data_dir=tmp_path / "broker", kind="mosquitto",
                            extra_config=documented_lab_listener(ws_port))  # fmt: skip
    instance.ws_port = ws_port
    yield instance
    instance.stop()
    print(f"--- broker log ---\n{instance.log_tail(50)}")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless Chromium for the module (each test opens its own page with ``open_page``)."""
    from selenium.webdriver.chrome.service import Service

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SE_OFFLINE", "true")  # selenium-manager: never fetch a browser or driver
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for console_errors
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}", "--window-size=1400,1400"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def open_page(driver, url: str) -> None:  # noqa: ANN001
    """``url`` in the module's browser, its console cleared of what the previous page logged."""
    driver.get("about:blank")
    driver.get_log("browser")
    driver.get(url)


def console_errors(driver) -> list[str]:  # noqa: ANN001
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def text(driver, css: str) -> str:  # noqa: ANN001
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css)


def texts(driver, css: str) -> list[str]:  # noqa: ANN001
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.textContent);", css)


def dashboard(*, ws_port: int, tls: bool = False) -> DashboardServer:
    return DashboardServer(PageConfig(federation="it", ws_port=ws_port, ws_host="127.0.0.1", tls=tls), port=0).start()


def wait_subscribed(driver) -> None:  # noqa: ANN001
    wait_until(lambda: driver.execute_script("return window.skyfedDashboard.subscribed.length") == 7,
               timeout_s=15, what="the page's subscriptions")  # fmt: skip


@pytest.fixture
def page(ws_broker, browser):
    """The dashboard of federation ``it`` on ``ws_broker``, open in the browser and subscribed."""
    server = dashboard(ws_port=ws_broker.ws_port)
    open_page(browser, server.url)
    wait_subscribed(browser)
    yield server
    server.stop()


@pytest.fixture
def player(ws_broker):
    """A client that publishes what a test makes up, as the server or an agent would."""
    client = MqttClient("test-player", BrokerSettings(host=ws_broker.host, port=ws_broker.port), persistent=False)
    assert client.start(timeout_s=10)
    yield client
    client.stop()


def rounds_done(driver) -> int:  # noqa: ANN001
    shown = text(driver, "#rounds-done")
    return int(shown) if shown.isdigit() else 0


def points(driver) -> int:  # noqa: ANN001
    return int(driver.find_element("id", "score-chart").get_attribute("data-points"))


def agent_states(driver) -> dict[str, str]:  # noqa: ANN001
    return driver.execute_script(
        "const out = {}; for (const tr of document.querySelectorAll('#agents tbody tr'))"
        " out[tr.getAttribute('data-agent')] = tr.querySelector('[data-state]').getAttribute('data-state');"
        " return out;"
    )


def test_page_follows_a_live_federation_and_reads_no_model_or_update_topic(tmp_path, ws_broker, browser, page):
    fed = Federation(tmp_path, ws_broker, rounds=3, agents=2)
    topics = Topics("it")
    watcher = MqttClient("test-watcher", BrokerSettings(host=ws_broker.host, port=ws_broker.port), persistent=False)
    watcher.subscribe(topics.server_metrics)
    assert watcher.start(timeout_s=10)
    try:
        assert text(browser, "#connection") == "connected"
        server = Aggregator(load_server_config(fed.layout.server_config))
        server_thread = threading.Thread(target=server.run, daemon=True)
        server_thread.start()
        fed.start_agents()
        lags = []
        for _ in range(3):  # each metrics publish: the round counter, its row and the lead curve follow within 2 s
            message = wait_until(lambda: watcher.poll(0.05), timeout_s=90, what="round metrics")
            published_at, metrics = time.monotonic(), RoundMetrics.from_json(message[1])
            # at least round m: rounds take well under a second, so the next one may already be on the page
            wait_until(lambda m=metrics: rounds_done(browser) >= m.round
                       and points(browser) >= m.round
                       and str(m.round) in texts(browser, "#updates tbody tr td:first-child"),
                       timeout_s=2.0, what=f"round {metrics.round} on the page within 2 s")  # fmt: skip
            lags.append(time.monotonic() - published_at)
        print(f"page lag after each metrics publish: {', '.join(f'{lag:.2f} s' for lag in lags)}")
        assert texts(browser, "#updates tbody tr td:first-child") == ["3", "2", "1"], "every round, once"
        assert text(browser, "#score-title") == f"{metrics.headline[0]['label']} / loss"
        server_thread.join(30)
        assert set(agent_states(browser)) == {a.id for a in fed.agents}
        wait_until(lambda: text(browser, "#agents-online") == "2", timeout_s=10, what="2 agents online")
        fed.close()  # a clean stop: each agent publishes its offline status
        wait_until(lambda: set(agent_states(browser).values()) == {"offline"}, timeout_s=10, what="agents offline")
        wait_until(lambda: text(browser, "#agents-online") == "0", timeout_s=2, what="the count follows the rows")
        assert text(browser, "#server-online-note").startswith("as of "), "the finished server's count is dated"
        assert browser.find_element("id", "online-mismatch").get_attribute("hidden") is not None
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
        print(f"screenshot: {shot}")
        hook = browser.execute_script("return {granted: window.skyfedDashboard.granted,"
                                      " dropped: window.skyfedDashboard.dropped};")  # fmt: skip
        granted = {g["topic"]: g["qos"] for g in hook["granted"]}
        assert sorted(granted) == sorted([topics.server_status, topics.server_metrics, topics.server_history,
                                          topics.agent_status_wildcard,
                                          *(topics.peer_wildcard(leaf) for leaf in ("member", "metrics", "best"))])
        assert granted[topics.server_metrics] == 1, "metrics at QoS 1: a round's row is not dropped"
        assert not [t for t in granted if any(u in t for u in UPDATE_TOPICS) or "#" in t]
        assert hook["dropped"] == 0
        assert console_errors(browser) == []
    finally:
        fed.close()
        watcher.stop()


def test_page_opened_late_lists_every_round_of_the_history_then_live_ones_once(tmp_path, ws_broker, browser, player):
    fed = Federation(tmp_path, ws_broker, rounds=2, agents=2)
    fed.run(Aggregator(load_server_config(fed.layout.server_config)))
    page = dashboard(ws_port=ws_broker.ws_port)
    try:
        open_page(browser, page.url)
        wait_until(lambda: texts(browser, "#updates tbody tr td:first-child") == ["2", "1"], timeout_s=10,
                   what="both finished rounds listed from the retained history")  # fmt: skip
        assert points(browser) == 2 and text(browser, "#phase") == "finished"
        assert text(browser, "#updates tbody tr td.scores").startswith("accuracy 0."), "the history's lead score"
        wait_subscribed(browser)
        for number in (2, 3):  # round 2 again (the history holds it) and a new round 3, live
            metrics = round_metrics(round=number, accepted=["d1"], eval={"accuracy": 0.5, "loss": 1.0})
            player.publish(Topics("it").server_metrics, metrics.to_json())
        wait_until(lambda: texts(browser, "#updates tbody tr td:first-child") == ["3", "2", "1"], timeout_s=5,
                   what="live rounds merged with the history's, each once")  # fmt: skip
        accepted = texts(browser, "#updates tbody tr td:nth-child(4)")
        assert accepted == ["d1", "d1", "2 agents"], "a live round's names replace the history's counts"
        assert points(browser) == 3 and console_errors(browser) == []
    finally:
        page.stop()


def test_a_new_run_under_the_same_name_replaces_the_last_runs_rounds(browser, page, player):
    """A server started again under this federation's name counts its rounds from 1: the page kept the last run's
    rounds beside the new run's, under the same numbers. Rounds name their run."""
    from broker_server.watch.history import RunHistory

    topics = Topics("it")
    for number in (1, 2, 3):
        player.publish(topics.server_metrics, round_metrics(round=number, accepted=["old"], run_id="a").to_json())
    wait_until(lambda: texts(browser, "#updates tbody tr td:first-child") == ["3", "2", "1"], timeout_s=5,
               what="the first run's rounds")  # fmt: skip
    late, history = RunHistory("it"), RunHistory("it")
    late.add(round_metrics(round=2, run_id="a"))  # the same run's history, merely late: nothing changes
    history.add(round_metrics(round=1, eval={"accuracy": 0.25, "loss": 0.75}, run_id="b"))
    player.publish(topics.server_history, late.payload())
    player.publish(topics.server_history, history.payload())
    live = round_metrics(round=2, accepted=["new"], eval={"accuracy": 0.5, "loss": 0.5}, run_id="b")
    player.publish(topics.server_metrics, live.to_json())
    wait_until(lambda: texts(browser, "#updates tbody tr td:first-child") == ["2", "1"], timeout_s=5,
               what="the new run's rounds alone")  # fmt: skip
    assert texts(browser, "#updates tbody tr td:nth-child(4)") == ["new", "1 agents"]
    assert points(browser) == 2 and console_errors(browser) == []
    player.publish(topics.server_metrics, round_metrics(round=1, run_id="c").to_json())  # live first, this time
    wait_until(lambda: texts(browser, "#updates tbody tr td:first-child") == ["1"], timeout_s=5,
               what="the third run's round alone")  # fmt: skip


def publish_json(client: MqttClient, topic: str, document: dict, retain: bool = False) -> None:
    client.publish(topic, json.dumps(document).encode(), retain=retain)


def test_groups_pairs_and_the_lead_score_are_readable_text(browser, page, player):
    topics = Topics("it")
    groups = [{"level": 2, "group": "0", "members": ["d1", "d2", "d3"], "g_gen": 0.7},
              {"level": 1, "group": "00", "members": ["d1", "d2"], "g_gen": 0.81}]  # as DemLearn reports them
    demlearn = round_metrics(round=1, strategy="demlearn", models="group", aggregation={"groups": groups},
                             personal={"c_spe": 0.9, "c_gen": 0.6, "trained": {"c_spe": 0.95, "c_gen": 0.55}},
                             eval={"accuracy": 0.5, "loss": 1.2},
                             bytes_up=467_109, bytes_down=622_000)  # fmt: skip
    swap = round_metrics(round=2, strategy="simfedswap", models="agent", personal={"c_spe": 0.91},
                         aggregation={"pairs": [["d1", "d2"]], "pair_similarity": [0.125]},
                         bytes_up=1_250_000, bytes_down=622_000)  # fmt: skip
    for metrics in (demlearn, swap):
        player.publish(topics.server_metrics, metrics.to_json())
    wait_until(lambda: len(texts(browser, "#updates tbody tr")) == 2, timeout_s=5, what="both rounds' rows")
    swaps, grouped = texts(browser, "#updates tbody tr td:last-child")
    assert grouped == ("groups: group 0 (level 2): d1, d2, d3, G-GEN 0.7000 | "
                       "group 00 (level 1): d1, d2, G-GEN 0.8100")
    assert swaps == "pairs: d1↔d2 (0.13)"
    lead = text(browser, "#updates tbody tr[data-round='1'] td.scores")
    assert lead == ("C-SPE 0.9000 · trained C-SPE 0.9500 · C-GEN 0.6000 · trained C-GEN 0.5500 · "
                    "global accuracy 0.5000 · global loss 1.2000")
    assert text(browser, "#score-title") == "C-SPE / loss", "the chart leads with headline[0]"
    assert browser.execute_script("return window.skyfedDashboard.charts.score.plot.series[1].label") == "C-SPE"
    assert points(browser) == 2 and console_errors(browser) == []


BROKEN_WORDS = """
const broken = [];
for (const el of document.querySelectorAll("#updates th, #updates td.words, #updates td.scores > span")) {
  const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest(".free")) continue;
    for (const match of node.data.matchAll(/\\S+/g)) {
      const range = document.createRange();
      range.setStart(node, match.index);
      range.setEnd(node, match.index + match[0].length);
      if (new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size > 1) broken.push(match[0]);
    }
  }
}
return broken;
"""


def test_the_rounds_table_breaks_no_word_of_its_own_nor_a_score_at_the_pages_width(browser, page, player):
    """At 1,400 px a round of DemLearn's six scores, ten agents and its groups squeezed the other columns until
    their headers and values broke inside words ("ro/u/n/d", "com/mit/ted"): a score kept its line whole, so
    the scores column took half the table. Scores now wrap between them, each on one line."""
    groups = [{"level": 2, "group": "0", "members": ["d1", "d2", "d3"], "g_gen": 0.7},
              {"level": 1, "group": "00", "members": ["d1", "d2"], "g_gen": 0.81}]  # fmt: skip
    agents = [f"agent-{i:02d}" for i in range(10)]
    for number in (1, 2):
        metrics = round_metrics(round=number, strategy="demlearn", models="group", aggregation={"groups": groups},
                                personal={"c_spe": 0.9, "c_gen": 0.6, "trained": {"c_spe": 0.95, "c_gen": 0.55}},
                                eval={"accuracy": 0.5, "loss": 1.2}, participants=agents, accepted=agents,
                                rejected=[Rejection("agent-10", "x" * 300)],
                                bytes_up=467_109, bytes_down=622_000)  # fmt: skip
        player.publish(Topics("it").server_metrics, metrics.to_json())
    wait_until(lambda: len(texts(browser, "#updates tbody tr")) == 2, timeout_s=5, what="both rounds' rows")
    assert browser.execute_script(BROKEN_WORDS) == []
    assert text(browser, "#updates tbody tr td.scores").startswith("C-SPE 0.9000 · trained C-SPE 0.9500 · ")
    width = browser.execute_script("return [document.getElementById('updates').scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], "a payload's long word still wraps: the table stays within the page"


AXES = """
    const out = [];
    for (const [name, c] of Object.entries(window.skyfedDashboard.charts)) {
      c.plot.axes.forEach((a, i) => {
        if (!a.show || i === 0) return;
        c.plot.ctx.font = a.font[0];
        const widths = a._values.map(v => c.plot.ctx.measureText(v).width / devicePixelRatio);
        out.push({chart: name, label: a.label, values: a._values, size: a._size,
                  needed: Math.max(...widths) + a.ticks.size + a.gap});
      });
    }
    return out;"""


def test_every_axis_has_units_and_room_for_its_labels(browser, page, player):
    # checked after every round's draw: a draw whose layout passes change the tick labels clipped them
    for number, (up, down) in enumerate([(467_109, 622_000), (470_000, 1_622_000), (90_000, 2_500_000)], 1):
        metrics = round_metrics(round=number, bytes_up=up, bytes_down=down, eval={"accuracy": 0.5, "loss": 1234.5},
                                privacy={"epsilon": number * 1.5})  # fmt: skip
        player.publish(Topics("it").server_metrics, metrics.to_json())
        wait_until(lambda n=number: points(browser) == n, timeout_s=5, what=f"round {number} drawn")
        time.sleep(0.3)  # uPlot draws on the next animation frame
        axes = browser.execute_script(AXES)
        for axis in axes:
            assert axis["label"], f"{axis['chart']}: an unnamed axis"
            assert axis["size"] >= axis["needed"], f"{axis['chart']} {axis['label']}: labels clipped: {axis}"
    bytes_ticks = next(a["values"] for a in axes if a["chart"] == "bytes")
    assert all(re.fullmatch(r"\d+(\.\d+)? (B|kB|MB)", v) for v in bytes_ticks), bytes_ticks
    assert text(browser, "#updates tbody tr[data-round='1'] td:nth-child(6)") == "467 kB / 622 kB"
    assert console_errors(browser) == []


def test_a_wss_broker_the_page_cannot_reach_is_explained_with_the_url_to_open(browser):
    closed = free_port()  # nothing listens there
    page = dashboard(tls=True, ws_port=closed)
    try:
        open_page(browser, page.url)
        help_text = wait_until(lambda: text(browser, "#connection-help"), timeout_s=15, what="the page's advice")
        visit = f"https://127.0.0.1:{closed}/"
        assert f"wss://127.0.0.1:{closed}/mqtt" in help_text and visit in help_text
        assert browser.find_element("css selector", "#connection-help a").get_attribute("href") == visit
        assert text(browser, "#connection") == "reconnecting"
    finally:
        page.stop()


def test_hostile_fields_stay_bounded_text_and_the_server_count_is_shown_beside_the_rows(browser, page, player):
    topics = Topics("it")
    markup = '<img src=x onerror="window.pwned=1">'
    now = time.time()
    gated = AgentStatus(agent="d1", state="idle", round=4, samples=1, version=1, updated_at=now,
                        gate=Gate(ok=False, reasons=["battery 12% < 30%", "x" * 100_000]), detail=markup)
    player.publish(topics.agent_status("d1"), gated.to_json(), retain=True)
    named = AgentStatus(agent=markup, state="idle", round=4, samples=1, version=1, updated_at=now)
    player.publish(topics.agent_status(markup), named.to_json(), retain=True)
    # a replayed offline status the server refused: the row shows it, the server's count says otherwise
    replay = AgentStatus(agent="d2", state="offline", round=3, samples=1, version=1, updated_at=now - 600)
    player.publish(topics.agent_status("d2"), replay.to_json(), retain=True)
    status = ServerStatus(state="running", federation="it", round=4, phase="collecting", strategy="demlearn",
                          model_version=4, agents_online=3, updated_at=now)  # fmt: skip
    player.publish(topics.server_status, status.to_json(), retain=True)
    metrics = round_metrics(round=4, accepted=["d1", markup], rejected=[Rejection("d3", f"bounds {markup}")],
                            aggregation={"groups": [{"level": 1, "group": markup, "members": [markup] * 500}]},
                            eval={"accuracy": 0.5})  # fmt: skip
    document = json.loads(metrics.to_json())
    document["headline"] = [{"key": "accuracy", "label": markup, "value": 0.5},
                            {"key": "c_spe", "label": "C-SPE", "value": 0.99},  # not the round's number: dropped
                            {"key": "trained_c_gen", "label": "trained C-GEN", "value": 0.99}]  # nor this
    publish_json(player, topics.server_metrics, document)
    wait_until(lambda: agent_states(browser).get("d1") == "gated", timeout_s=5, what="d1 gated")
    wait_until(lambda: text(browser, "#updates tbody tr"), timeout_s=5, what="the round's row")
    row = text(browser, "#updates tbody tr")
    assert "d3 (bounds <img" in row and f"group {markup[:15]}…" in row and "+480 more" in row
    assert text(browser, "#updates tbody tr td.scores") == f"{markup} 0.5000", "as text; the forged lead dropped"
    assert browser.execute_script("return window.skyfedDashboard.forged") == 2
    assert text(browser, "#score-title") == f"{markup[:23]}… / loss", "an axis title, cut shorter"
    assert "battery 12% < 30%" in text(browser, "#agents tbody tr[data-agent='d1']")
    assert max(len(t) for t in texts(browser, "#agents td, #updates td")) < 2000, "a flood in a field is cut"
    assert markup in agent_states(browser)
    wait_until(lambda: text(browser, "#server-online") == "3", timeout_s=5, what="the server's count")
    assert text(browser, "#agents-online") == "2", "the rows shown online: d1 (gated) and the markup-named one"
    assert "The server counts 3 agents online, the agent rows show 2" in text(browser, "#online-mismatch")
    assert browser.execute_script("return document.querySelectorAll('img').length") == 0
    assert browser.execute_script("return window.pwned === undefined")
    assert console_errors(browser) == []


def test_an_async_servers_buffer_and_each_rounds_staleness_and_lost_updates_are_shown(browser, page, player):
    topics = Topics("it")
    assert browser.execute_script("return document.getElementById('buffer-card').hidden"), "hidden: a sync server"
    status = ServerStatus(state="running", federation="it", round=7, phase="training", strategy="fedavg",
                          model_version=8, agents_online=5, updated_at=time.time(),
                          buffer={"size": 5, "filled": 2, "in_flight": "<b>3</b>"})  # fmt: skip
    player.publish(topics.server_status, status.to_json(), retain=True)
    wait_until(lambda: text(browser, "#buffer"), timeout_s=5, what="the buffer card")
    assert text(browser, "#buffer") == "2/5 updates, <b>3</b> agents training, model v8", "claims shown as text"
    metrics = round_metrics(round=7, accepted=["d1"], eval={"accuracy": 0.5})
    document = {**json.loads(metrics.to_json()), "wasted": {"stale": 1, "late": "x"},
                "buffer": {"size": 5, "updates": 5, "late": 2, "staleness_mean": 0.5, "staleness_max": 1}}
    publish_json(player, topics.server_metrics, document)
    wait_until(lambda: text(browser, "#updates tbody tr"), timeout_s=5, what="the round's row")
    assert "staleness 0.50; lost 1 late or stale" in text(browser, "#updates tbody tr")
    assert console_errors(browser) == []


def test_a_peer_federation_shows_a_row_per_peer_and_the_model_most_peers_adopted(tmp_path, browser, page, player):
    topics = Topics("it")
    markup = '<img src=x onerror="window.pwned=1">'
    honest = Adoption("c0ffee" * 10 + "abcd", "p2", 0.88)

    def publish(peer: str, leaf: str, message: object, signer: str | None = None) -> None:
        payload = signed_payload(message.to_dict(), Identity.generate(signer or peer))  # the page checks none
        player.publish(topics.peer_wildcard(leaf).replace("+", peer), payload, retain=True)

    shown = "return [...document.querySelectorAll('.server-only')].map(e => e.offsetParent !== null)"
    assert all(browser.execute_script(shown)), "before any peer: the server's cards, charts, agents and rounds"
    for n, peer in enumerate(("p1", "p2", "p3", "p4"), 1):
        gate = Gate(ok=False, reasons=["battery 12% < 30%"]) if peer == "p3" else Gate()
        publish(peer, "member", PeerMember("it", peer, "left" if peer == "p1" else "member", 3, 5.0, 6.0, gate))
        rejected = [{"peer": "p4", "reason": markup}] if peer != "p4" else []
        trained = {"c_spe": markup} if peer == "p4" else {"c_spe": 0.9 + n / 100}  # p4's is no number: not shown
        publish(peer, "metrics", PeerRoundMetrics(peer, 2, "aggregated", {"accuracy": 0.8 + n / 100, "loss": 0.5},
                                                  ["p1", "p2", "p3"], rejected, personal={"trained": trained}))
        adopted = Adoption("f" * 64, "p4", 1.0) if peer == "p4" else honest  # p4 says it adopted its own model
        publish(peer, "best", PeerBest("it", peer, 2, 0.8 + n / 100, f"{n}" * 64, 5.0, adopted))
    publish("p2", "metrics", PeerRoundMetrics("p1", 9, "aggregated", {"accuracy": 0.01}, []))  # p1's under p2's name
    wait_until(lambda: "elected by 3 of 4" in text(browser, "#peers"), timeout_s=5, what="the elected model marked")
    rows = browser.execute_script("const out = {}; for (const tr of document.querySelectorAll('#peers tbody tr'))"
                                  " out[tr.getAttribute('data-peer')] = [...tr.cells].map(c => c.textContent);"
                                  " return out;")  # fmt: skip
    assert sorted(rows) == ["p1", "p2", "p3", "p4"], "one row per peer"
    assert rows["p2"] == ["p2", "member", "3", "2", "accuracy 0.8200", "0.9200", "3", "1",
                          "0.8200 (222222222222) ◀ elected by 3 of 4 peers", "p2's (c0ffeec0ffee), 0.8800 here"]
    assert rows["p1"][1] == "left" and rows["p3"][1] == "member, gate blocked: battery 12% < 30%"
    assert rows["p4"][5] == "" and rows["p4"][8] == "0.8400 (444444444444)"
    assert rows["p4"][9] == "p4's (ffffffffffff), 1.0000 here"
    marked = texts(browser, "#peers tbody tr[data-peer] td[data-elected='yes']")
    assert len(marked) == 1 and marked[0].endswith("elected by 3 of 4 peers")
    assert "Elected: p2's model (c0ffeec0ffee), adopted by 3 of the 4 peers" in text(browser, "#peers-elected")
    assert browser.execute_script("return window.skyfedDashboard.peers.refused") == 1
    assert not any(browser.execute_script(shown)), "a peer federation has no server, agents or server rounds"
    assert browser.find_element("id", "connection").is_displayed() and "peer-federation" in browser.execute_script(
        "return document.body.className")  # fmt: skip
    shot = tmp_path / "peers.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
    print(f"screenshot: {shot}")
    assert browser.execute_script("return document.querySelectorAll('img').length") == 0
    assert browser.execute_script("return window.pwned === undefined")
    assert console_errors(browser) == []


FLOOD_METRICS, FLOOD_AGENTS, FLOOD_SERVER_STATUSES = 20_000, 6_000, 2_000
MAX_ROUNDS, MAX_AGENTS = 500, 5000  # the page's caps (dashboard.js)


def flood_messages(topics: Topics) -> list[tuple[str, bytes]]:
    """20,000 rounds of metrics, 6,000 agent ids (a rogue publisher: more than the page keeps) and 2,000 server
    statuses, interleaved, ending with round ``FLOOD_METRICS``'s metrics and status."""
    metrics = [(topics.server_metrics, round_metrics(round=n, eval={"accuracy": n / FLOOD_METRICS}).to_json())
               for n in range(1, FLOOD_METRICS + 1)]  # fmt: skip
    agents = [(topics.agent_status(f"rogue{i:05d}"), AgentStatus(agent=f"rogue{i:05d}", state="idle", round=i,
               samples=1, version=1, updated_at=0.0).to_json()) for i in range(FLOOD_AGENTS)]  # fmt: skip
    messages = []
    for i, message in enumerate(metrics):
        messages.append(message)
        if i * FLOOD_AGENTS // FLOOD_METRICS != (i + 1) * FLOOD_AGENTS // FLOOD_METRICS:
            messages.append(agents[i * FLOOD_AGENTS // FLOOD_METRICS])
        if (i + 1) % (FLOOD_METRICS // FLOOD_SERVER_STATUSES) == 0:
            status = ServerStatus(state="running", federation="it", round=i + 1, phase="collecting",
                                  strategy="fedavg", model_version=i, agents_online=3, updated_at=0.0)  # fmt: skip
            messages.append((topics.server_status, status.to_json()))
    return messages


def test_page_catches_up_with_a_flood_within_its_caps(ws_broker, browser, page):
    """Each message only updates the page's state and the page redraws at most every 250 ms, so 28,000 messages
    published as fast as one paho client can are all drawn within 30 s of the last one; the DOM keeps its caps."""
    import paho.mqtt.client as paho

    topics = Topics("it")
    messages = flood_messages(topics)
    flood = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="test-flood")
    flood.max_queued_messages_set(0)  # QoS 0 into paho's own buffer: the loop thread writes as fast as it can
    flood.connect(ws_broker.host, ws_broker.port)
    flood.loop_start()
    try:
        started = time.monotonic()
        sent = [flood.publish(topic, payload, qos=0) for topic, payload in messages]
        sent[-1].wait_for_publish(60)
        published_s = time.monotonic() - started
        assert published_s < 30, f"the flood itself took {published_s:.1f} s to publish"
        last = str(FLOOD_METRICS)
        wait_until(lambda: text(browser, "#rounds-done") == last and text(browser, "#round") == last
                   and len(agent_states(browser)) == MAX_AGENTS, timeout_s=30, what="the page caught up")  # fmt: skip
        caught_up_s = time.monotonic() - started
        hook = browser.execute_script("const h = window.skyfedDashboard; return {messages: h.messages, draws: h.draws,"
                                      " rounds: h.rounds.size, notShown: h.agentsNotShown, dropped: h.dropped};")
        print(f"flood: {len(messages)} messages published in {published_s:.1f} s, page caught up after "
              f"{caught_up_s:.1f} s; page read {hook['messages']}, drew {hook['draws']} times")
        assert points(browser) == MAX_ROUNDS and hook["rounds"] == MAX_ROUNDS
        assert browser.execute_script("return document.querySelectorAll('#updates tbody tr').length") == MAX_ROUNDS
        assert text(browser, "#updates tbody tr td") == last, "the newest round's row on top"
        assert hook["draws"] <= caught_up_s * 4 + 2, "at most one draw per 250 ms"
        assert hook["notShown"] == FLOOD_AGENTS - MAX_AGENTS and hook["dropped"] == 0
        assert f"first {MAX_AGENTS} agent ids" in text(browser, "#agents-capped")
        assert min(agent_states(browser)) == "rogue00000", "the first ids kept, in order"
        assert console_errors(browser) == []
    finally:
        flood.loop_stop()
        flood.disconnect()
