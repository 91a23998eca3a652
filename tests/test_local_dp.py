"""Local DP-SGD on the agent (Opacus): its own epsilon, a durable budget, and no volunteering once spent."""

from __future__ import annotations

import pytest
import torch

from broker_server.config import load_server_config
from broker_server.daemon import Aggregator
from flcore.update import UpdateMeta
from models.datasets import load_dataset, load_digits
from models.serialization import loads
from models.weights import to_arrays
from models.zoo import build_model
from participant.classifier import ClassifierTrainer
from participant.local_dp import LocalPrivacySection, PrivacyBudget, epsilon_of, incompatibility, steps_of
from protocol.messages import TrainSettings
from tests.fedharness import Federation, override_toml, round_task

POLICY = LocalPrivacySection(noise_multiplier=1.0, max_grad_norm=1.0)


def test_dp_sgd_trains_spends_and_remembers_across_a_restart(tmp_path):
    train, _ = load_digits(test_fraction=0.2, seed=0)
    path = tmp_path / "privacy.json"
    budget = PrivacyBudget(POLICY, path, len(train))
    trainer = ClassifierTrainer(train, device=torch.device("cpu"), agent_id="a", work_dir=tmp_path, budget=budget)
    arrays = to_arrays(build_model("mlp_digits"))
    first = trainer.train(arrays, round_task(model="mlp_digits", round=1))
    second = trainer.train(first.arrays, round_task(model="mlp_digits", round=2))
    assert 0 < first.epsilon < second.epsilon
    assert second.loss < first.loss  # it still learns
    # the RDP accountant's own answer for what was planned: 2 rounds of batch/N sampling
    rate, steps = steps_of(TrainSettings(), len(train))
    assert second.epsilon == pytest.approx(epsilon_of([(1.0, rate, steps)] * 2, 1e-5), rel=0.02)
    assert PrivacyBudget(POLICY, path, len(train)).epsilon == pytest.approx(second.epsilon)  # after a restart


def test_the_budget_refuses_the_round_that_would_pass_the_target(tmp_path):
    samples = 150
    rate, steps = steps_of(TrainSettings(), samples)
    eps1, eps2 = (epsilon_of([(1.0, rate, steps)] * k, 1e-5) for k in (1, 2))
    budget = PrivacyBudget(
        LocalPrivacySection(noise_multiplier=1.0, target_epsilon=(eps1 + eps2) / 2), tmp_path / "p.json", samples
    )
    task = round_task(model="mlp_digits", round=1)
    assert budget.refusal(task, "agent-01") == "" and budget.refusal(None, "agent-01") == ""
    budget.spend([(1.0, rate, steps)], task.train_of("agent-01"))
    refusal = budget.refusal(None, "agent-01")
    assert refusal.startswith("privacy-budget-spent") and budget.refusal(task, "agent-01") == refusal


def test_a_model_with_batchnorm_is_refused_with_the_reason():
    assert "BatchNorm" in incompatibility("digits_cnn", 10) and incompatibility("mlp_digits", 10) == ""


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"noise_multiplier": -1.0}, "privacy.noise_multiplier must be >= 0"),
        ({"noise_multiplier": 1.0, "max_grad_norm": 0.0}, "privacy.max_grad_norm must be > 0"),
        ({"noise_multiplier": 1.0, "delta": 1.0}, "privacy.delta must be in (0, 1)"),
        ({"target_epsilon": 3.0}, "needs privacy.noise_multiplier > 0"),
    ],
)
def test_bad_local_privacy_settings_name_the_key(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LocalPrivacySection(**values)


def test_an_agent_whose_budget_is_spent_stops_volunteering(tmp_path, broker):
    """agent-03 runs DP-SGD with a target that affords exactly one round: it trains one round (its
    epsilon in its status and in its update's metadata), then closes its gate and is not selected again."""
    targets: list[float] = []

    def edit(layout) -> None:  # noqa: ANN001
        override_toml(layout.server_config, server={"model": "mlp_digits"}, rounds={"min_agents": 2, "quorum": 2})
        config = layout.agent_configs["agent-03"]
        rate, steps = steps_of(TrainSettings(epochs=1, batch_size=32), len(load_dataset(config.parent / "data.npz")))
        targets.extend(epsilon_of([(1.0, rate, steps)] * k, 1e-5) for k in (1, 2))
        override_toml(config, privacy={"noise_multiplier": 1.0, "target_epsilon": sum(targets) / 2})

    fed = Federation(tmp_path, broker, rounds=3, agents=3, edit=edit)
    eps1 = targets[0]
    server = Aggregator(load_server_config(fed.layout.server_config))
    fed.run(server)
    accepted = [sorted(m.accepted) for m in fed.metrics()]
    # a round opens once min_agents (2) hold the group key, so agent-03 may join in round 1 or 2
    private_rounds = [number for number, names in enumerate(accepted, 1) if "agent-03" in names]
    assert len(private_rounds) == 1 and private_rounds[0] < 3, accepted
    assert all(names == ["agent-01", "agent-02"] for names in accepted[private_rounds[0] :]), accepted
    private = fed.agents[2]
    status = server.registry.agents["agent-03"]
    assert status.privacy["epsilon"] == pytest.approx(eps1, rel=0.02) and status.privacy["target_epsilon"] > eps1
    assert not status.gate.ok and status.gate.reasons[0].startswith("privacy-budget-spent")
    meta = UpdateMeta.from_metadata(loads(private.client.store.stored_update(private_rounds[0]))[1])
    assert meta.local_epsilon == pytest.approx(eps1, rel=0.02) and meta.local_delta == 1e-5
    assert UpdateMeta.from_metadata(loads(fed.agents[0].client.store.stored_update(3))[1]).local_epsilon is None
