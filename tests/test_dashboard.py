"""The dashboard's server side: the bounded history the server keeps retained, and the page server's files."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request

import pytest

from broker_server.watch.dashboard.server import DashboardServer, PageConfig
from broker_server.watch.history import RunHistory
from protocol.mqtt import BrokerSettings, MqttClient
from tests.fedharness import ServerHarness, round_metrics, wait_until


def test_history_keeps_the_newest_rounds_within_its_round_bound():
    history = RunHistory("fleet", max_rounds=10)
    for number in range(1, 31):
        history.add(round_metrics(round=number, eval={"accuracy": number / 100, "loss": 1.0}))
    rows = json.loads(history.payload())["rounds"]
    assert [r["round"] for r in rows] == list(range(21, 31))
    assert rows[-1]["headline"] == [["accuracy", 0.3], ["loss", 1.0]] and rows[-1]["loss"] == 1.0


def test_history_rows_lead_with_the_rounds_headline_and_the_payload_names_each_score():
    history = RunHistory("fleet")
    history.add(round_metrics(round=1, strategy="demlearn", models="group", eval={"accuracy": 0.5, "loss": 1.2},
                              personal={"c_spe": 0.912345678, "c_gen": 0.6,
                                        "trained": {"c_spe": 0.95, "c_gen": 0.55}}))  # fmt: skip
    body = json.loads(history.payload())
    assert body["rounds"][0]["headline"] == [["c_spe", 0.912346], ["trained_c_spe", 0.95], ["c_gen", 0.6],
                                             ["trained_c_gen", 0.55], ["accuracy", 0.5], ["loss", 1.2]]
    assert body["labels"] == {"c_spe": "C-SPE", "trained_c_spe": "trained C-SPE", "c_gen": "C-GEN",
                              "trained_c_gen": "trained C-GEN", "accuracy": "global accuracy", "loss": "global loss"}


def test_history_payload_never_exceeds_its_byte_bound():
    history = RunHistory("fleet", max_bytes=4096)
    for number in range(1, 501):
        history.add(round_metrics(round=number, eval={"accuracy": 0.5}, privacy={"epsilon": number * 0.01},
                                  accepted=[f"a{i}" for i in range(50)], bytes_up=10**9))  # fmt: skip
    payload = history.payload()
    assert len(payload) <= 4096
    rows = json.loads(payload)["rounds"]
    assert rows[-1]["round"] == 500 and rows[-1]["accepted"] == 50
    assert [r["round"] for r in rows] == list(range(rows[0]["round"], 501)), "the newest rounds, contiguous"


def test_history_seeds_from_metrics_jsonl_and_skips_a_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(round_metrics(round=1).to_json() + b"\n{not json\n" + round_metrics(round=2).to_json() + b"\n")
    history = RunHistory("fleet")
    history.seed(path)
    assert [r["round"] for r in json.loads(history.payload())["rounds"]] == [1, 2]


@pytest.mark.integration
def test_server_publishes_retained_history_a_late_subscriber_reads(tmp_path, broker):
    with ServerHarness(tmp_path, broker, agents=2) as h:
        h.announce_agents()
        for seed, agent in enumerate(h.agents):
            h.send(agent, h.random_delta(seed))
        h.wait_metrics()
        late = MqttClient("late-page", BrokerSettings(host=broker.host, port=broker.port), persistent=False)
        late.subscribe(h.topics.server_history)
        assert late.start(timeout_s=10)
        try:
            def rounds():
                message = late.poll(0.1)
                return message and json.loads(message[1])["rounds"]

            rows = wait_until(rounds, timeout_s=10, what="the retained history")
        finally:
            late.stop()
    assert [r["round"] for r in rows] == [1] and rows[0]["accepted"] == 2


def fetch(url: str) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, b"", dict(exc.headers)


def test_page_server_serves_page_config_and_vendored_libraries_only():
    server = DashboardServer(PageConfig(federation="fleet", ws_port=9001, ws_host="broker.lan"), port=0).start()
    try:
        status, page, headers = fetch(server.url)
        assert status == 200 and b"dashboard.js" in page and "default-src 'self'" in headers["Content-Security-Policy"]
        status, config, _ = fetch(server.url + "config.js")
        assert status == 200
        settings = json.loads(config.decode().split("=", 1)[1].rstrip().rstrip(";"))
        assert settings == {"federation": "fleet", "ws_port": 9001, "ws_host": "broker.lan", "ws_path": "/mqtt",
                            "tls": False, "peer_scores": [["accuracy", "accuracy"], ["map50", "mAP@.5"]]}  # fmt: skip
        assert fetch(server.url + "vendor/mqtt.min.js")[0] == 200
        assert fetch(server.url + "vendor/uPlot.iife.min.js")[0] == 200
        assert fetch(server.url + "vendor/")[0] == 404, "no directory listings"
        assert fetch(server.url + "../server.py")[0] == 400, "never outside static/"
        assert fetch(server.url + "vendor/missing.js")[0] == 404
    finally:
        server.stop()


def test_page_config_names_a_bad_federation():
    with pytest.raises(ValueError, match="federation"):
        PageConfig(federation="a/#", ws_port=9001)


def raw_request(url: str, request_line: bytes) -> bytes:
    """The status line the page server answers to ``request_line`` sent as is (no client-side quoting)."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(request_line + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
        return conn.makefile("rb").readline()


@pytest.mark.parametrize("path", [b"/%00", b"/index.html%00.js", b"/vendor/%00", b"/%ff%fe", b"/vendor//x.js",
                                  b"/%2e%2e/server.py", b"/vendor/..%2f..%2fserver.py", b"/%0a", b"/" + b"a" * 5000,
                                  b"/\\..\\server.py"])  # fmt: skip
def test_page_server_answers_a_malformed_path_400_without_a_traceback(path, capfd, caplog):
    caplog.set_level(logging.INFO, logger="skyfed.dashboard")
    server = DashboardServer(PageConfig(federation="fleet", ws_port=9001), port=0).start()
    try:
        for method in (b"GET", b"HEAD"):
            assert raw_request(server.url, method + b" " + path + b" HTTP/1.1").split()[1] == b"400"
        assert raw_request(server.url, b"GET /dashboard.js HTTP/1.1").split()[1] == b"200", "still serving"
        assert server.httpd.bad_paths == 2
    finally:
        server.stop()
    assert "Traceback" not in capfd.readouterr().err and "Traceback" not in caplog.text
    assert "event=dashboard-bad-path" in caplog.text
