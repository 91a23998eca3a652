"""Agents hosted in one process (``sim.agent_host``) share its cores: at most ``--jobs-at-once`` of their jobs run at
once, the others waiting their turn (``participant.jobs.OnSharedCores``)."""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import pytest

from flcore.update import TrainResult
from participant.jobs import InProcessRunner, OnSharedCores, Trained
from sim.slow import SlowTrainer
from tests.fedharness import round_task

STEP_S = 0.05


class Counting:
    """A trainer that notes how many of its kind train at once."""

    budget = None
    lock = threading.Lock()

    def __init__(self, seen: list[int], running: list[int]) -> None:
        self.seen, self.running = seen, running

    def train(self, global_arrays, task, context=None):  # noqa: ANN001, ANN201 - participant.trainer.Trainer
        with self.lock:
            self.running[0] += 1
            self.seen.append(self.running[0])
        time.sleep(STEP_S)
        with self.lock:
            self.running[0] -= 1
        return TrainResult(dict(global_arrays), samples=1, loss=0.0)


def outcomes(jobs: list, timeout_s: float = 10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while any(job.poll() is None for job in jobs) and time.monotonic() < deadline:
        time.sleep(0.005)
    return [job.poll() for job in jobs]


def train_all(cores: threading.Semaphore | None, count: int = 6) -> list[int]:
    seen: list[int] = []
    running = [0]
    runners = [InProcessRunner(Counting(seen, running), cores) for _ in range(count)]
    arrays = {"w": np.zeros(3, np.float32)}
    done = outcomes([r.train(arrays, round_task()) for r in runners])
    assert all(isinstance(o, Trained) for o in done)
    return seen


def test_hosted_agents_train_at_most_as_many_at_once_as_their_shared_cores_and_all_of_them_finish():
    assert max(train_all(threading.BoundedSemaphore(2))) == 2
    assert max(train_all(None)) > 2  # unbounded, the same six overlap


def test_a_slow_agent_waits_outside_the_core_so_another_agent_trains_meanwhile():
    cores = threading.BoundedSemaphore(1)
    seen: list[int] = []
    running = [0]
    slow = InProcessRunner(Counting(seen, running), cores)
    slow.trainer = SlowTrainer(slow.trainer, 40.0)  # as sim.agent_host wraps it: after the core's wrapper
    fast = InProcessRunner(Counting(seen, running), cores)
    arrays = {"w": np.zeros(3, np.float32)}
    slow_job = slow.train(arrays, round_task())
    time.sleep(4 * STEP_S)  # its training is over and it is waiting the rest of its slowdown
    started = time.monotonic()
    assert isinstance(outcomes([fast.train(arrays, round_task())])[0], Trained)
    assert time.monotonic() - started < 20 * STEP_S  # not behind the slow agent's whole wait (about 80 steps)
    assert slow_job.poll() is None
    slow_job.cancel("test over")


def test_a_host_process_shares_one_bound_among_its_agents_and_zero_lifts_it(tmp_path):
    from sim.agent_host import build_agents
    from sim.federation import SimSettings, create_federation

    layout = create_federation(tmp_path, SimSettings(agents=3, rounds=1), ("127.0.0.1", 1883))
    configs = [str(c) for c in layout.agent_configs.values()]
    args = argparse.Namespace(config=configs, attacker=[], attack="", scope="parameters", slow=[], slowdown=1.0,
                              jobs_at_once=2)  # fmt: skip
    trainers = [a.runner.trainer for a in build_agents(args)]
    assert all(isinstance(t, OnSharedCores) for t in trainers)
    assert len({id(t.cores) for t in trainers}) == 1
    args.jobs_at_once = 0
    assert not any(isinstance(a.runner.trainer, OnSharedCores) for a in build_agents(args))


def test_a_negative_bound_is_refused_at_start(capsys):
    from sim.agent_host import main

    with pytest.raises(SystemExit) as stopped:
        main(["--jobs-at-once", "-1"])
    assert stopped.value.code == 2
    assert "--jobs-at-once must be 0 (no bound) or more, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(("cores", "hosts", "each"), [(2, 1, 2), (2, 2, 1), (2, 10, 1), (16, 3, 5), (1, 0, 1)])
def test_the_sims_host_processes_split_the_machines_cores(monkeypatch, cores, hosts, each):
    from sim import launch

    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert launch.jobs_per_host(hosts) == each


def test_each_host_process_is_started_with_its_share_of_the_cores(tmp_path, monkeypatch):
    from sim import launch
    from sim.federation import SimSettings

    started = []
    monkeypatch.setattr(launch, "spawn", lambda args, log, module="skyfed": started.append((module, args)))
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: {0, 1})
    configs = {f"agent-{i:02d}": tmp_path / f"agent-{i:02d}.toml" for i in range(1, 6)}
    launch.spawn_agents(configs, SimSettings(agents=5, rounds=1, agents_per_process=2), tmp_path)
    hosts = [args for module, args in started if module == "sim.agent_host"]
    assert len(hosts) == 2 and all(args[args.index("--jobs-at-once") + 1] == "1" for args in hosts)
    assert [args[:2] for module, args in started if module == "skyfed"] == [["agent", "run"]], "the fifth, alone"
    started.clear()
    launch.spawn_agents(configs, SimSettings(agents=5, rounds=1, agents_per_process=5), tmp_path)
    (host,) = [args for module, args in started if module == "sim.agent_host"]
    assert host[host.index("--jobs-at-once") + 1] == "2"
