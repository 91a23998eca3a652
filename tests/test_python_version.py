"""Jetson boards run JetPack 6: Ubuntu 22.04, Python 3.10, and NVIDIA's CUDA PyTorch wheels for 3.10 only.
Every module the ``skyfed`` command can import must therefore run on 3.10 (``common.toml`` falls back to
the ``tomli`` backport there); vermin reads the code and names the minimum version each construct needs."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["agent", "protocol", "security", "common", "models", "flcore", "participant", "broker_server", "region",
            "provisioning", "sim", "benchmarks", "skyfed"]


def test_the_installed_code_runs_on_python_3_10():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "vermin"), "--no-tips", "--violations", "--target=3.10-", *PACKAGES],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Minimum required versions: 3.10" in result.stdout


def test_setup_cfg_admits_python_3_10_and_installs_the_toml_backport_there():
    text = (ROOT / "setup.cfg").read_text()
    assert "python_requires = >=3.10" in text and 'tomli; python_version < "3.11"' in text
