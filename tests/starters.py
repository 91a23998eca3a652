"""Which tests start processes, read from their code: the rule behind the ``integration`` marker.

A test starts a broker, a daemon, a browser or another process when its code, or the code of a test helper,
harness or fixture it reaches, names one of ``STARTERS``. Code under ``tests/`` is followed through every
global name it uses (functions, classes and their methods, nested functions and lambdas); project code is
not followed, so the project's own process starters are named here. A test that starts processes only
through a project entry point not named here (``sim.run.run_sim`` on a non-in-process federation) carries
``@pytest.mark.integration`` by hand; the ``_in_process_only`` fixture in conftest fails one that does not.
"""

from __future__ import annotations

import inspect
from types import CodeType, FunctionType, ModuleType

# modules (any use) and the project's classes and functions that start a process: a broker, the agent daemon
# (its GPU probe and training children), the CLI
STARTERS = frozenset({
    "subprocess", "multiprocessing", "selenium.webdriver",
    "sim.broker.start_broker", "sim.broker.LocalBroker", "sim.nats_cluster.start_nats_cluster", "sim.run.spawn",
    "agent.daemon.EdgeAgent", "agent.runner.ChildRunner", "agent.runner.TrainingChild",
    "agent.device.cuda_device_count", "agent.device.check_device_present",
})  # fmt: skip
# executables that a test in the fast tier must not start, besides Python itself (checked at run time)
DAEMONS = frozenset({"mosquitto", "nats-server", "chromedriver", "chromium", "skyfed"})
_verdicts: dict[int, bool] = {}


def _is_starter(name: str) -> bool:
    return any(name == s or name.startswith(s + ".") for s in STARTERS)


def _qualified(obj: object) -> str:
    if isinstance(obj, ModuleType):
        return obj.__name__
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


def _codes(code: CodeType):  # noqa: ANN202
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _codes(const)


def _functions(obj: object) -> list[FunctionType]:
    """The test code an object holds: a function (unwrapped, hypothesis' inner test too) or a class's methods."""
    if isinstance(obj, type):
        members = [m for c in obj.__mro__ if c.__module__.startswith("tests") for m in vars(c).values()]
        return [f for m in members for f in _functions(getattr(m, "__func__", getattr(m, "fget", m)))
                if not isinstance(m, type)]  # fmt: skip
    if not callable(obj):
        return []
    inner = getattr(getattr(obj, "hypothesis", None), "inner_test", None)
    found = [inspect.unwrap(f) for f in (obj, inner) if f is not None]
    return [f for f in found if isinstance(f, FunctionType)]


def starts_processes(obj: object) -> bool:
    """Whether calling ``obj`` (a test, a fixture, a helper or a harness class) may start a process."""
    if id(obj) in _verdicts:
        return _verdicts[id(obj)]
    _verdicts[id(obj)] = False  # a cycle (a helper reaching itself) adds nothing
    verdict = False
    for function in _functions(obj):
        names = {n for code in _codes(function.__code__) for n in code.co_names}
        if any(_is_starter(n) for n in names):  # an import inside the function
            verdict = True
            break
        used = [function.__globals__[n] for n in names if n in function.__globals__]
        if any(_is_starter(_qualified(u)) for u in used):
            verdict = True
            break
        ours = [u for u in used if not isinstance(u, ModuleType) and _qualified(u).startswith("tests")]
        if any(starts_processes(u) for u in ours):
            verdict = True
            break
    _verdicts[id(obj)] = verdict
    return verdict
