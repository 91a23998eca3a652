"""Shared fixtures: a real broker on a free loopback port, started and stopped by each test.

Ultralytics is set up offline (no DNS probe, no pip, settings in a temp dir) before any test imports it.
Tests that start a broker, a daemon, a browser or another process are marked ``integration`` here, so
``pytest -m "not integration"`` (``make test-fast``) is the in-process tier.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# One thread per PyTorch (OpenMP) and OpenBLAS pool, here and in the daemons tests start: the suite runs a worker
# per core, and pools sized to the machine spin against each other (a digits CNN took 25x the CPU time). Set
# before PyTorch is first imported; a value already in the environment wins.
for pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(pool, "1")
# Derived datasets (models.dataset_cache) in a folder of this run's own, not the user's cache: the pytest-xdist
# workers and the daemons tests start inherit it; the process that made it removes it.
if "SKYFED_CACHE_DIR" not in os.environ:
    os.environ["SKYFED_CACHE_DIR"] = tempfile.mkdtemp(prefix="skyfed-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SKYFED_CACHE_DIR"], ignore_errors=True)

from models.yolo import ultralytics_offline  # noqa: E402
from sim.broker import mosquitto_path, start_broker  # noqa: E402
from tests.fixtures import config, dataset  # noqa: E402, F401 - fixtures shared by several test files
from tests.liveharness import peer_broker, peers, provisioned, workdir  # noqa: E402, F401 - fixtures shared by several test files
from tests.starters import DAEMONS, starts_processes  # noqa: E402

# one settings folder per pytest-xdist worker: two workers never write the same settings file
ultralytics_offline(Path(tempfile.gettempdir()) / f"skyfed-test-ultralytics{os.environ.get('PYTEST_XDIST_WORKER', '')}")


@pytest.fixture
def broker(tmp_path):
    """A fresh mosquitto (persistence on) for one test; CI installs mosquitto, so a missing one fails."""
    kind = "mosquitto"
    if mosquitto_path() is None:
        if os.environ.get("SKYFED_ALLOW_EMBEDDED_BROKER") != "1":
            pytest.fail("mosquitto is not installed: apt-get install mosquitto (or SKYFED_ALLOW_EMBEDDED_BROKER=1)")
        kind = "iotcore"
    instance = start_broker(data_dir=tmp_path / "broker", kind=kind)
    yield instance
    instance.stop()
    print(f"--- broker log (shown by pytest only when the test failed) ---\n{instance.log_tail(50)}")


@pytest.fixture(scope="module")
def ultralytics_utils():
    """Ultralytics' dataset checks (``ultralytics.data.utils``), kept from downloading a plotting font."""
    from ultralytics.data import utils

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utils, "check_font", lambda *args, **kwargs: None)  # a plotting font it would download
        yield utils


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``integration`` every test whose code, helpers or fixtures (the whole fixture closure) start a
    process (``tests/starters.py`` says how that is read)."""
    for item in items:
        if isinstance(item, pytest.Function) and item.get_closest_marker("integration") is None:
            closure = item._fixtureinfo.name2fixturedefs
            fixtures = [d.func for name, defs in closure.items() if name != "_in_process_only" for d in defs]
            if any(starts_processes(f) for f in [item.function, *fixtures]):
                item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _in_process_only(request, monkeypatch):
    """The check on that marking: a test left unmarked that starts a broker, a browser or a Python process (the
    CLI, a daemon, a training child) fails, naming the command, instead of slowing the fast tier unseen."""
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    started: list[str] = []
    popen_init = subprocess.Popen.__init__

    def watched(self, args, *rest, **kwargs):  # noqa: ANN001, ANN002, ANN003
        argv = [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
        if Path(argv[0]).name in DAEMONS or argv[0] == sys.executable:
            started.append(" ".join(argv[:4]))
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", watched)
    yield
    assert not started, f"started {started} without the integration marker: mark it (see tests/starters.py)"
