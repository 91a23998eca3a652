"""What a command's process imports before it does anything: the heavy libraries only where they are used.
Start-up is paid by every daemon restart under systemd and every CLI call on an operator's laptop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "module, absent",
    [
        ("sim.report", "torch"),  # skyfed report draws with matplotlib alone (4.3 s when it imported PyTorch)
        ("broker_server.daemon", "dp_accounting"),  # only a run that computes an epsilon loads it (1.3 s)
        ("models.zoo", "torch"),  # naming and checking a model; its networks are built on first use
        ("sim.run", "matplotlib"),  # the curves are drawn once the run is over
    ],
)
def test_a_module_starts_without_what_it_does_not_use(module: str, absent: str) -> None:
    assert imported(f"import {module}", absent) == []


def test_skyfed_sim_checks_its_settings_and_lays_out_digits_without_pytorch(tmp_path: Path) -> None:
    """Everything ``skyfed sim`` does before its daemons start: PyTorch there (3 s) was paid before any of them."""
    setup = ("from pathlib import Path; from sim.settings import SimSettings, agent_names; "
             "from sim.classify_layout import write_classify_data; SimSettings(agents=4, strategy={'name': 'krum'}); "
             f"write_classify_data(Path({str(tmp_path)!r}), agent_names(4), 'iid', 1)")  # fmt: skip
    assert imported(setup, "torch") == []


def imported(statements: str, package: str) -> list[str]:
    """The first few modules of ``package`` that a fresh interpreter holds after ``statements``."""
    probe = (f"import json, sys; {statements}; "
             f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == {package!r})[:3]))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
