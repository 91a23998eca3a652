"""``skyfed monitor`` shows whatever anyone publishes on the status topics, and never crashes on it."""

import json

from rich.console import Console

from broker_server.monitor import FederationView
from protocol.messages import AgentStatus
from protocol.topics import Topics
from security.keys import Identity
from security.signing import signed_payload
from tests.fedharness import round_metrics


def _render(view: FederationView) -> str:
    console = Console(record=True, width=200)
    console.print(view.render())
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
