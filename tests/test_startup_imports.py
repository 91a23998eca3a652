"""What a command's process imports before it does anything: the heavy libraries only where they are used.
Start-up is paid by every daemon restart under systemd and every CLI call on an operator's laptop."""

from __future__ import annotations

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
    ],
)
def test_a_module_starts_without_what_it_does_not_use(module: str, absent: str) -> None:
    probe = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == {absent!r})[:3])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stdout + done.stderr
