"""The dashboard page in a real headless Chromium, against a real federation over mosquitto's WebSockets listener.

Needs Debian's ``chromium`` and ``chromium-driver`` (.ci/run installs them) and selenium; skipped without them.
Selenium is pointed at the system browser and driver, so selenium-manager never downloads anything.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from broker_server.dashboard.server import DashboardServer, PageConfig
from protocol.messages import RoundMetrics
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.topics import Topics
from sim.broker import free_port, start_broker
from tests.fedharness import Federation, wait_until
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


@pytest.fixture
def browser(tmp_path, monkeypatch):
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium-manager: never fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,1400"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def text(driver, css: str) -> str:  # noqa: ANN001
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css)


def points(driver) -> int:  # noqa: ANN001
    return int(driver.find_element("id", "score-chart").get_attribute("data-points"))


def agent_states(driver) -> dict[str, str]:  # noqa: ANN001
    return driver.execute_script(
        "const out = {}; for (const tr of document.querySelectorAll('#agents tbody tr'))"
        " out[tr.getAttribute('data-agent')] = tr.querySelector('[data-state]').getAttribute('data-state');"
        " return out;"
    )


def test_page_follows_a_live_federation_and_reads_no_model_or_update_topic(tmp_path, ws_broker, browser):
    fed = Federation(tmp_path, ws_broker, rounds=3, agents=2)
    topics = Topics("it")
    page = DashboardServer(PageConfig(federation="it", ws_port=ws_broker.ws_port, ws_host="127.0.0.1"), port=0)
    page.start()
    watcher = MqttClient("test-watcher", BrokerSettings(host=ws_broker.host, port=ws_broker.port), persistent=False)
    watcher.subscribe(topics.server_metrics)
    assert watcher.start(timeout_s=10)
    try:
        browser.get(page.url)
        wait_until(lambda: text(browser, "#connection") == "connected", timeout_s=15, what="the page's connection")
        server = Aggregator(load_server_config(fed.layout.server_config))
        server_thread = threading.Thread(target=server.run, daemon=True)
        server_thread.start()
        fed.start_agents()
        lags = []
        for _ in range(3):  # each metrics publish: the round counter and the accuracy curve follow within 2 s
            message = wait_until(lambda: watcher.poll(0.05), timeout_s=90, what="round metrics")
            published_at, metrics = time.monotonic(), RoundMetrics.from_json(message[1])
            wait_until(lambda m=metrics: text(browser, "#rounds-done") == str(m.round) and points(browser) == m.round,
                       timeout_s=2.0, what=f"round {metrics.round} on the page within 2 s")  # fmt: skip
            lags.append(time.monotonic() - published_at)
        print(f"page lag after each metrics publish: {', '.join(f'{lag:.2f} s' for lag in lags)}")
        server_thread.join(30)
        assert set(agent_states(browser)) == {a.id for a in fed.agents}
        fed.close()  # a clean stop: each agent publishes its offline status
        wait_until(lambda: set(agent_states(browser).values()) == {"offline"}, timeout_s=10, what="agents offline")
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
        print(f"screenshot: {shot}")
        hook = browser.execute_script("return {subscribed: window.skyfedDashboard.subscribed,"
                                      " dropped: window.skyfedDashboard.dropped};")  # fmt: skip
        assert sorted(hook["subscribed"]) == sorted([topics.server_status, topics.server_metrics,
                                                     topics.server_history, topics.agent_status_wildcard])
        assert not [t for t in hook["subscribed"] if any(u in t for u in UPDATE_TOPICS) or "#" in t]
        assert hook["dropped"] == 0
    finally:
        fed.close()
        watcher.stop()
        page.stop()


def test_page_opened_late_draws_the_whole_run_from_retained_history(tmp_path, ws_broker, browser):
    fed = Federation(tmp_path, ws_broker, rounds=2, agents=2)
    fed.run(Aggregator(load_server_config(fed.layout.server_config)))
    page = DashboardServer(PageConfig(federation="it", ws_port=ws_broker.ws_port, ws_host="127.0.0.1"), port=0)
    page.start()
    try:
        browser.get(page.url)
        wait_until(lambda: points(browser) == 2, timeout_s=10, what="both finished rounds drawn")
        assert text(browser, "#phase") == "finished"
    finally:
        page.stop()


def test_rejections_swap_pairs_and_gates_are_shown_and_payload_markup_stays_text(tmp_path, ws_broker, browser):
    from protocol.messages import AgentStatus, Gate, Rejection
    from tests.fedharness import round_metrics

    topics = Topics("it")
    page = DashboardServer(PageConfig(federation="it", ws_port=ws_broker.ws_port, ws_host="127.0.0.1"), port=0)
    page.start()
    player = MqttClient("test-player", BrokerSettings(host=ws_broker.host, port=ws_broker.port), persistent=False)
    assert player.start(timeout_s=10)
    try:
        browser.get(page.url)
        wait_until(lambda: text(browser, "#connection") == "connected", timeout_s=15, what="the page's connection")
        markup = '<img src=x onerror="window.pwned=1">'
        gated = AgentStatus(agent="d1", state="idle", round=4, samples=1, version=1, updated_at=time.time(),
                            gate=Gate(ok=False, reasons=["battery 12% < 30%"]), detail=markup)  # fmt: skip
        player.publish(topics.agent_status("d1"), gated.to_json(), retain=True)
        metrics = round_metrics(round=4, accepted=["d1", "d2"], rejected=[Rejection("d3", f"bounds {markup}")],
                                aggregation={"pairs": [["d1", "d2"]]}, eval={"accuracy": 0.5})  # fmt: skip
        player.publish(topics.server_metrics, metrics.to_json())
        wait_until(lambda: agent_states(browser).get("d1") == "gated", timeout_s=5, what="d1 gated")
        wait_until(lambda: text(browser, "#updates tbody tr"), timeout_s=5, what="the round's row")
        row = text(browser, "#updates tbody tr")
        assert "d3 (bounds <img" in row and "d1↔d2" in row
        assert "battery 12% < 30%" in text(browser, "#agents tbody tr")
        assert browser.execute_script("return document.querySelectorAll('img').length") == 0
        assert browser.execute_script("return window.pwned === undefined")
    finally:
        player.stop()
        page.stop()


FLOOD_METRICS, FLOOD_AGENTS, FLOOD_SERVER_STATUSES = 20_000, 6_000, 2_000
MAX_ROUNDS, MAX_AGENTS, MAX_UPDATE_ROWS = 500, 5000, 50  # the page's caps (dashboard.js)


def flood_messages(topics: Topics) -> list[tuple[str, bytes]]:
    """20,000 rounds of metrics, 6,000 agent ids (a rogue publisher: more than the page keeps) and 2,000 server
    statuses, interleaved, ending with round ``FLOOD_METRICS``'s metrics and status."""
    from protocol.messages import AgentStatus, ServerStatus
    from tests.fedharness import round_metrics

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


def test_page_catches_up_with_a_flood_within_its_caps(tmp_path, ws_broker, browser):
    """Each message only updates the page's state and the page redraws at most every 250 ms, so 28,000 messages
    published as fast as one paho client can are all drawn within 30 s of the last one; the DOM keeps its caps."""
    import paho.mqtt.client as paho

    topics = Topics("it")
    messages = flood_messages(topics)
    page = DashboardServer(PageConfig(federation="it", ws_port=ws_broker.ws_port, ws_host="127.0.0.1"), port=0)
    page.start()
    flood = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="test-flood")
    flood.max_queued_messages_set(0)  # QoS 0 into paho's own buffer: the loop thread writes as fast as it can
    flood.connect(ws_broker.host, ws_broker.port)
    flood.loop_start()
    try:
        browser.get(page.url)
        wait_until(lambda: browser.execute_script("return window.skyfedDashboard.subscribed.length") == 4,
                   timeout_s=15, what="the page's subscriptions")  # fmt: skip
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
        assert browser.execute_script("return document.querySelectorAll('#updates tbody tr').length") == MAX_UPDATE_ROWS
        assert text(browser, "#updates tbody tr td") == last, "the newest round's row on top"
        assert hook["draws"] <= caught_up_s * 4 + 2, "at most one draw per 250 ms"
        assert hook["notShown"] == FLOOD_AGENTS - MAX_AGENTS and hook["dropped"] == 0
        assert f"first {MAX_AGENTS} agent ids" in text(browser, "#agents-capped")
        assert min(agent_states(browser)) == "rogue00000", "the first ids kept, in order"
    finally:
        flood.loop_stop()
        flood.disconnect()
        page.stop()
