"""The on-board ONNX export's timing: a version is exported once it has been the newest held for SETTLE_S, so
rounds faster than that export only the version they stop at, and a round's start model is exported as soon
as its (longer) training is over."""

from __future__ import annotations

import time

import agent.onboard
from agent.onboard import OnboardModel
from tests.fedharness import round_task


class Recorder:
    """A runner that only notes what it was asked to export."""

    def __init__(self) -> None:
        self.exported: list[int] = []

    def export(self, arrays, task, path):  # noqa: ANN001, ANN201
        self.exported.append(int(arrays["version"]))
        return object()


def models(version: int) -> dict:
    return {version: {"version": version}}


def test_a_version_is_exported_once_it_settled_and_one_superseded_sooner_never(tmp_path, monkeypatch):
    monkeypatch.setattr(agent.onboard, "SETTLE_S", 0.2)
    runner = Recorder()
    onboard = OnboardModel(tmp_path, runner)  # type: ignore[arg-type]
    for version in (1, 2, 3):  # rounds closing every 0.05 s, each task naming its start model
        onboard.hold(version)
        onboard.export_newest(round_task(model_version=version), models(version), time.time())
        time.sleep(0.05)
    assert runner.exported == []
    time.sleep(0.2)
    onboard.hold(3)
    onboard.export_newest(round_task(model_version=3), models(3), time.time())
    assert runner.exported == [3] and onboard.version == 3


def test_a_start_model_held_through_a_longer_training_is_exported_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(agent.onboard, "SETTLE_S", 0.2)
    runner = Recorder()
    onboard = OnboardModel(tmp_path, runner)  # type: ignore[arg-type]
    onboard.hold(4)  # the round's model arrives; training (0.3 s) runs: the daemon's steps tell hold, not export
    time.sleep(0.3)
    onboard.hold(4)
    onboard.export_newest(round_task(model_version=4), models(4), time.time())  # its update has left: idle
    assert runner.exported == [4]
