"""Shared fixtures: a real broker on a free loopback port, started and stopped by each test.

Ultralytics is set up offline (no DNS probe, no pip, settings in a temp dir) before any test imports it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.yolo import ultralytics_offline  # noqa: E402
from sim.broker import mosquitto_path, start_broker  # noqa: E402

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
