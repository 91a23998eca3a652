"""Strategies declare what they can do, and every check asks the declaration, never the name: a strategy
registered in a test (one ``STRATEGIES.add``) is run under privacy, refused by peers and refused for a
detector exactly as it declares, and the capability table of docs/strategies.md is the registry's."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from broker_server.config import ConfigError, load_server_config
from broker_server.privacy.noise import NORM_SLACK
from broker_server.privacy.policy import PrivacyPolicy
from broker_server.rounds.engine import RoundEngine
from flcore.bounds import InfluencePolicy
from flcore.strategies import STRATEGIES
from flcore.strategies.base import Contribution, RoundResult, Strategy
from flcore.strategies.capabilities import capability_table
from security.replay import ReplayGuard
from sim.federation import SimSettings, create_federation
from tests.fedharness import override_toml
from tests.fixtures import dp_completed

DOC = Path(__file__).resolve().parent.parent / "docs" / "strategies.md"


class Mean(Strategy):
    """A plain unweighted mean of the clipped deltas; subclasses declare the rest."""

    def aggregate(self, global_vector: np.ndarray, contributions: list[Contribution]) -> RoundResult:
        mean = sum(np.asarray(c.delta, np.float32) * c.scale for c in contributions) / len(contributions)
        return RoundResult(global_vector + mean)


class BoundedMean(Mean):
    name = "toy-bounded"

    def dp_sensitivity(self, updates: int, clip: float) -> float:
        return clip / updates


class Unbounded(Mean):
    name = "toy-unbounded"
    why_not_private = "its toy mean declares no bound"


class ServerOnly(Mean):
    name = "toy-server-only"
    peers = "it needs the toy server's ledger"


class NotPeers(Mean):
    name = "toy-not-peers"
    peers = False


class ClassifyOnly(Mean):
    name = "toy-classify"
    tasks = frozenset({"classify"})
    why_not_tasks = "needs a toy loss the detector trainer does not have"


@pytest.fixture
def register(request):  # noqa: ANN201
    def add(kind: type[Strategy]) -> None:
        STRATEGIES.add(kind.name, kind)
        request.addfinalizer(lambda: STRATEGIES.remove(kind.name))

    return add


@pytest.fixture
def server_config(tmp_path: Path) -> Path:
    settings = SimSettings(agents=3, rounds=1, federation="caps")
    return create_federation(tmp_path, settings, ("127.0.0.1", 1)).server_config


def test_a_strategy_with_a_sensitivity_bound_runs_under_privacy_with_noise_calibrated_to_it(register, server_config):
    register(BoundedMean)
    z, clip = 1.0, 0.5
    override_toml(server_config, rounds={"min_agents": 3, "quorum": 3}, strategy={"name": "toy-bounded"},
                  privacy={"clip": clip, "noise_multiplier": z})  # fmt: skip
    config = load_server_config(server_config)  # no list of names to add it to
    engine = RoundEngine(config, replay=ReplayGuard(3600), evaluator=lambda arrays: {"accuracy": 0.5})
    agents = ["agent-01", "agent-02", "agent-03"]
    engine.begin_round(agents, now=0.0)
    engine.announce(now=0.0)
    for i, agent in enumerate(agents):
        engine.accept(dp_completed(engine, agent, seed=i), now=1.0)
    metrics = engine.close(now=1.0, model_wire_bytes=0)
    assert metrics.outcome == "committed" and metrics.privacy["epsilon"] > 0
    assert metrics.aggregation["noise_std"] == pytest.approx(z * clip * (1 + NORM_SLACK) / 3, rel=1e-9)
    with pytest.raises(ValueError, match="weight_cap weighs FedAvg's updates, and strategy toy-bounded is unweighted"):
        PrivacyPolicy(clip=clip, noise_multiplier=z, weight_cap=10.0).check_compatible({"name": "toy-bounded"},
                                                                                       InfluencePolicy())  # fmt: skip


def test_a_strategy_without_a_bound_is_refused_under_privacy_with_its_declared_reason(register, server_config):
    register(Unbounded)
    override_toml(server_config, strategy={"name": "toy-unbounded"}, privacy={"clip": 0.5, "noise_multiplier": 1.0})
    with pytest.raises(ConfigError, match="privacy cannot run strategy.name = 'toy-unbounded': its toy mean declares "
                       "no bound. Use fedavg, .*trimmed-mean"):  # fmt: skip
        load_server_config(server_config)


def peer_plan(strategy: str, model: str = "digits_cnn", **detector: object):  # noqa: ANN201
    from agent.peer.plan import FederationSection

    return FederationSection(mode="peer", model=model, rounds=1, threshold=1, strategy={"name": strategy}, **detector)


@pytest.mark.parametrize("kind, why", [(ServerOnly, "it needs the toy server's ledger"),
                                       (NotPeers, "it declares that it does not work between peers")])  # fmt: skip
def test_peer_mode_refuses_a_strategy_that_declares_it_cannot_run_between_peers(register, kind, why):
    register(kind)
    choices = ", ".join(STRATEGIES.where(lambda strategy: strategy.peers is True))  # the registry's, toys left out
    assert "auto" in choices and "fedavg" in choices and kind.name not in choices
    with pytest.raises(ValueError, match=f"federation.strategy.name '{kind.name}' does not work between peers: {why}; "
                       f"choose one of {choices}$"):  # fmt: skip
        peer_plan(kind.name)
    register(BoundedMean)
    assert peer_plan("toy-bounded").build_strategy().name == "toy-bounded"  # declared nothing: peers run it


def test_a_classifier_only_strategy_is_refused_for_a_detector_with_its_reason(register, server_config):
    register(ClassifyOnly)
    override_toml(server_config, strategy={"name": "toy-classify"})
    assert load_server_config(server_config).strategy["name"] == "toy-classify"  # a classifier: fine
    override_toml(server_config, server={"model": "yolo11n", "classes": ["car", "truck"], "num_classes": 0})
    why = "strategy toy-classify needs a toy loss the detector trainer does not have: choose one of auto, fedavg,"
    with pytest.raises(ConfigError, match=why):
        load_server_config(server_config)
    with pytest.raises(ValueError, match=f"federation.strategy.name: {why}"):
        peer_plan("toy-classify", model="yolo11n", classes=["car", "truck"], image_size=64)


def test_skyfed_sim_offers_every_registered_strategy(register):
    from skyfed import build_parser

    register(BoundedMean)
    assert build_parser().parse_args(["sim", "--strategy", "toy-bounded"]).strategy == "toy-bounded"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sim", "--strategy", "toy-missing"])


def test_declarations_agree_with_what_each_strategy_does():
    """A strategy that keeps models or steps a server optimizer cannot run between peers (a peer has neither),
    and one refused for a task or under privacy says why."""
    for name, kind in STRATEGIES.items():
        if kind.keeps_models or kind.server_step is not Strategy.server_step:
            assert kind.peers is not True, name
        assert kind.tasks == {"classify", "detect"} or kind.why_not_tasks, name
        assert not kind.swaps or kind.keeps_models, name


def test_the_capability_table_in_the_docs_is_the_registrys():
    text = DOC.read_text()
    match = re.search(r"<!-- generated: capability_table\(\) -->\n(.*?)<!-- end generated -->", text, re.S)
    assert match, "docs/strategies.md lost its generated capability table"
    assert match.group(1) == capability_table(), "regenerate it: python -c 'from flcore.strategies.capabilities " \
        "import capability_table; print(capability_table())'"
