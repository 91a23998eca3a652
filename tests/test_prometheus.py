"""``[metrics] prometheus_port``: the daemons' Prometheus endpoints, scraped over HTTP during real federations."""

import math
import re
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from agent.config import load_agent_config
from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from flcore.update import FORMAT
from models.serialization import dumps
from protocol.config import ConfigError
from protocol.messages import headline
from protocol.mqtt import BrokerSettings, MqttClient
from protocol.prometheus import MAX_LABEL_VALUES, BoundedLabel
from security.keys import Identity
from sim.broker import free_port
from sim.federation import SimSettings, create_federation
from tests.fedharness import Federation, ServerHarness, override_toml, wait_until
from tests.liveharness import scrape, scrape_or_none

ROOT = Path(__file__).resolve().parent.parent


def rejected_by_reason(samples: dict) -> dict[str, float]:
    return {dict(labels)["reason"]: v for (name, labels), v in samples.items()
            if name == "skyfed_server_updates_rejected_total"}  # fmt: skip


def test_server_and_agent_endpoints_follow_a_two_round_federation(tmp_path, broker):
    server_port, agent_port = free_port(), free_port()

    def edit(layout):
        override_toml(layout.server_config, metrics={"prometheus_port": server_port}, rounds={"quorum": 2})
        override_toml(layout.agent_configs["agent-01"], metrics={"prometheus_port": agent_port})

    fed = Federation(tmp_path, broker, rounds=2, agents=2, edit=edit)
    server = Aggregator(load_server_config(fed.layout.server_config), keep_running=True)  # scraped after its rounds
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    thread.start()
    fed.start_agents()
    seen: list[dict] = []
    driver = MqttClient("test-driver", BrokerSettings(host=broker.host, port=broker.port), persistent=False)

    def scraped_until(predicate) -> dict:  # noqa: ANN001
        def once() -> dict | None:
            samples = scrape_or_none(server_port)
            if samples is not None:
                seen.append(samples)
            return samples if samples is not None and predicate(samples) else None

        return wait_until(once, 90, "the server's metrics")

    try:
        scraped_until(lambda s: s[("skyfed_server_round", ())] >= 1)
        assert driver.start(timeout_s=10)
        forged = driver.publish(server.topics.agent_update("agent-01"), b"SKF\x01" + bytes(100))  # a forged chunk
        assert MqttClient.wait_published([forged], 10)
        final = scraped_until(lambda s: s[("skyfed_server_rounds_total", (("outcome", "committed"),))] == 2)
        wait_until(lambda: server.rejections, what="the forged chunk's refusal")
        final = scraped_until(lambda s: rejected_by_reason(s) == dict(server.rejections))
        done, sent = ("skyfed_agent_last_completed_round", ()), ("skyfed_agent_updates_sent_total", ())
        # round 2 is completed when its training ends; its update counts once the broker acknowledged it
        agent = wait_until(lambda: (a := scrape_or_none(agent_port)) and a[done] == 2 and a[sent] == 2 and a,
                           what="agent metrics after both updates were acknowledged")
    finally:
        stop.set()
        fed.close()
        driver.stop()
        thread.join(15)
    rounds = [s[("skyfed_server_round", ())] for s in seen]
    accepted = [s[("skyfed_server_updates_accepted_total", ())] for s in seen]
    assert rounds == sorted(rounds) and {1, 2} <= set(rounds)
    assert accepted == sorted(accepted) and accepted[-1] == 4  # 2 agents x 2 rounds, never going back
    assert rejected_by_reason(final) == {"malformed": 1}
    last = fed.metrics()[-1]
    assert final[("skyfed_server_eval_score", ())] == pytest.approx(headline(last.eval))
    scores = {s[("skyfed_server_eval_score", ())] for s in seen}
    assert len({v for v in scores if not math.isnan(v)}) >= 2  # it moved: round 1's model, then round 2's
    assert final[("skyfed_server_upload_bytes_total", ())] == sum(m.bytes_up for m in fed.metrics()) > 0
    assert final[("skyfed_server_download_bytes_total", ())] == sum(m.bytes_down for m in fed.metrics()) > 0
    assert final[("skyfed_server_round_duration_seconds", ())] == last.duration_s > 0
    assert final[("skyfed_server_phase", (("phase", "finished"),))] == 1
    assert final[("skyfed_server_agents_online", ())] == 2
    assert final[("skyfed_server_epsilon", ())] == math.inf  # no [privacy]: no guarantee
    assert any(s[("skyfed_server_participants", ())] == 2 for s in seen)
    assert agent[("skyfed_agent_sent_bytes_total", ())] > 0
    assert agent[("skyfed_agent_training_seconds_total", ())] > 0
    assert agent[("skyfed_agent_gate_open", ())] == 1 and agent[("skyfed_agent_gate_reasons", ())] == 0
    assert scrape_or_none(server_port) is None and scrape_or_none(agent_port) is None  # closed with their daemons


def test_a_rogue_agents_invented_reasons_keep_the_reason_label_bounded(tmp_path, broker):
    port = free_port()
    with ServerHarness(tmp_path, broker, metrics={"prometheus_port": port}) as h:
        h.announce_agents()
        rogue = h.agents["agent-01"]
        sent = 0
        for i in range(40):  # every refusal's text differs; what the attacker wrote must not become a label
            evil = f"evil-{i}: x"
            h.publish_update("agent-01", h.sealed(rogue, dumps(h.random_delta(i), metadata={"format": evil})))
            h.publish_update("agent-01", h.sealed(rogue, dumps(h.random_delta(i), metadata={"format": FORMAT,
                                                                                           "round": evil})))
            h.publish_update(f"ghost-{i}", [f"SKF\x01{evil}".encode(), bytes([i]) * (i + 1)])
            h.publish_update("agent-01", h.sealed(Identity.generate("agent-01"), f"{evil}".encode()))
            sent += 5
        wait_until(lambda: sum(h.server.rejections.values()) >= sent, what="every refusal")
        reasons = wait_until(lambda: (r := rejected_by_reason(scrape(port))) and sum(r.values()) >= sent and r)
    assert sum(reasons.values()) == sum(h.server.rejections.values())
    assert len(reasons) <= 5 and all(re.fullmatch(r"[a-z][a-z0-9-]*", r) for r in reasons), reasons
    assert not any("evil" in r for r in reasons)


def test_the_reason_label_takes_only_code_like_words_and_a_bounded_number_of_them():
    label = BoundedLabel()
    assert label("digest-mismatch") == "digest-mismatch"
    assert label("Evil Reason {x}") == label("a" * 100) == label("") == label("norm\n") == "other"
    values = {label(f"kind-{i}") for i in range(MAX_LABEL_VALUES * 3)}
    assert len(values | {"digest-mismatch"}) == MAX_LABEL_VALUES + 1 and "other" in values
    assert label("digest-mismatch") == "digest-mismatch"  # one seen before the limit keeps its own series


def test_epsilon_and_eval_score_say_when_there_is_no_guarantee_or_no_evaluation():
    from broker_server.watch.prometheus import ServerMetrics
    from protocol.messages import ServerStatus
    from protocol.prometheus import MetricsSection

    metrics = ServerMetrics(MetricsSection())  # off: the registry alone, no endpoint
    value = metrics.registry.get_sample_value
    status = ServerStatus(state="running", federation="f", round=3, phase="training", strategy="fedavg",
                          model_version=2, agents_online=4, updated_at=0.0)  # fmt: skip
    metrics.status(status, participants=3)
    assert math.isnan(value("skyfed_server_eval_score")) and value("skyfed_server_epsilon") == math.inf
    metrics.status(replace(status, eval={"map50": 0.25}, privacy={"epsilon": 1.5}), participants=0)
    assert value("skyfed_server_eval_score") == 0.25 and value("skyfed_server_epsilon") == 1.5
    metrics.status(replace(status, privacy={"epsilon": None}), participants=0)  # a model went out without noise
    assert value("skyfed_server_epsilon") == math.inf
    assert value("skyfed_server_phase", {"phase": "training"}) == 1 and value("skyfed_server_round") == 3


def test_the_headline_score_is_what_the_run_is_judged_by_one_series_at_a_time():
    from broker_server.watch.prometheus import ServerMetrics
    from protocol.prometheus import MetricsSection
    from tests.fedharness import round_metrics

    metrics = ServerMetrics(MetricsSection())
    value = metrics.registry.get_sample_value
    metrics.round_closed(round_metrics(eval={"accuracy": 0.9, "loss": 0.3}))
    assert value("skyfed_server_headline_score", {"score": "accuracy"}) == 0.9
    assert value("skyfed_server_round_score", {"score": "loss"}) == 0.3
    metrics.round_closed(round_metrics(models="group", eval={"accuracy": 0.26}, personal={"c_spe": 0.67}))
    assert value("skyfed_server_headline_score", {"score": "c_spe"}) == 0.67
    assert value("skyfed_server_headline_score", {"score": "accuracy"}) is None  # the lead alone
    assert value("skyfed_server_round_score", {"score": "accuracy"}) == 0.26


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    return create_federation(tmp_path_factory.mktemp("fed"), SimSettings(agents=1, rounds=1), ("127.0.0.1", 1))


def copied_config(folder: Path, source: Path, beside: tuple[str, ...]) -> Path:
    """``source`` copied into ``folder``, the files it names linked beside it: a config a test may edit."""
    folder.mkdir()
    path = folder / source.name
    path.write_text(source.read_text())
    for name in beside:
        (folder / name).symlink_to(source.parent / name)
    return path


def server_config(folder: Path, layout) -> Path:  # noqa: ANN001
    return copied_config(folder, layout.server_config, ("server.key", "enrolled", "test.npz"))


@pytest.mark.parametrize(
    "metrics, message",
    [
        ({"prometheus_port": 70000}, "metrics.prometheus_port must be 1-65535 (0 = off), got 70000"),
        ({"prometheus_port": -1}, "metrics.prometheus_port must be 1-65535"),
        ({"prometheus_port": "9464"}, "metrics.prometheus_port has the wrong type"),
        ({"prometheus_port": 9.5}, "metrics.prometheus_port has the wrong type"),
        ({"prometheus_host": ""}, "metrics.prometheus_host must be an address"),
        ({"prometheus_prot": 9464}, "metrics.prometheus_prot is not a known key"),
    ],
)
def test_a_bad_metrics_table_fails_at_start_naming_the_key(tmp_path, layout, metrics, message):
    server = server_config(tmp_path / "server", layout)
    override_toml(server, metrics=metrics)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_server_config(server)
    agent = copied_config(tmp_path / "agent", layout.agent_configs["agent-01"],
                          ("agent-01.key", "server.pub", "data.npz", "test.npz"))  # fmt: skip
    override_toml(agent, metrics=metrics)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_agent_config(agent)


def test_server_check_says_where_the_endpoint_is_and_nothing_when_it_is_off(tmp_path, layout):
    from broker_server.config_summary import server_summary

    port = free_port()
    path = server_config(tmp_path / "server", layout)
    assert "prometheus" not in server_summary(load_server_config(path))
    override_toml(path, metrics={"prometheus_port": port})
    assert f" prometheus=http://127.0.0.1:{port}/metrics" in server_summary(load_server_config(path))


def test_a_metrics_port_in_use_stops_the_server_at_start_naming_the_key(tmp_path, layout):
    import socket

    path = server_config(tmp_path / "server", layout)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        override_toml(path, metrics={"prometheus_port": taken.getsockname()[1]})
        result = subprocess.run([sys.executable, "-m", "skyfed", "server", "run", "--config", str(path)], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "cannot listen on 127.0.0.1" in result.stderr and "metrics.prometheus_port" in result.stderr
    assert "Traceback" not in result.stderr


def test_sim_prometheus_port_serves_the_sims_server(tmp_path, broker):
    port = free_port()
    out = tmp_path / "run"
    sim = subprocess.Popen([sys.executable, "-m", "skyfed", "sim", "--agents", "2", "--rounds", "1", "--epochs", "1",
                            "--broker", f"{broker.host}:{broker.port}", "--prometheus-port", str(port),
                            "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)  # fmt: skip
    try:
        # any scrape of the server's metrics: a one-round run's round is over in well under a second, and a scrape
        # that waited for round 1 met a closed port once under load (the server serves them from its start)
        samples = wait_until(lambda: (s := scrape_or_none(port)) and ("skyfed_server_round", ()) in s and s,
                             timeout_s=120, what="the sim server's metrics")  # fmt: skip
    finally:
        _, stderr = sim.communicate(timeout=180)
    assert sim.returncode == 0, stderr
    assert ("skyfed_server_updates_accepted_total", ()) in samples
    assert "prometheus_port = " + str(port) in (out / "federation" / "server" / "server.toml").read_text()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"prometheus_port": 70000}, "--prometheus-port must be 1-65535, got 70000"),
        ({"prometheus_port": 9464, "in_process": True}, "--in-process runs no server daemon: drop it"),
    ],
)
def test_sim_refuses_a_prometheus_port_it_cannot_serve(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SimSettings(agents=2, rounds=1, **settings)


def test_with_regions_only_the_root_server_serves_the_sims_prometheus_port(tmp_path):
    from sim.regions import create_regions

    port = free_port()
    settings = SimSettings(agents=2, rounds=1, regions=2, federation="t", prometheus_port=port)
    layout = create_regions(tmp_path, settings, ("127.0.0.1", 1), [("127.0.0.1", 2), ("127.0.0.1", 3)])
    assert load_server_config(layout.flat.server_config).metrics.prometheus_port == port
    assert all(not load_server_config(path).metrics.enabled for path in layout.regions.values())  # no clash
