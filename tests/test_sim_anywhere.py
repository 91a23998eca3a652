"""``skyfed demo`` and ``skyfed sim`` as a user runs them: from any folder, with a relative ``--out``, and from a
wheel install (no checkout anywhere on the search path): metrics and the model land in that folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sim.launch import SOURCE_ROOT, child_pythonpath

ROOT = Path(__file__).resolve().parent.parent
SHORT = ("--agents", "2", "--rounds", "1", "--epochs", "1", "--deadline", "60")


def run_skyfed(args: list[str], cwd: Path, pythonpath: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-m", "skyfed", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip


def assert_results_in(out: Path, result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1] and rows[0]["outcome"] == "committed"
    assert (out / "global_model.safetensors").stat().st_size > 0
    assert f"results in {out.resolve()}/" in result.stdout and "final accuracy None" not in result.stdout


@pytest.mark.integration
def test_demo_from_another_folder_with_a_relative_out(tmp_path):
    """Before: the daemons ran in the package's folder and got ``--config runs/x/...``: "no such config file"."""
    (tmp_path / "elsewhere").mkdir()
    result = run_skyfed(["demo", *SHORT, "--out", "runs/x"], tmp_path / "elsewhere", str(ROOT))
    assert_results_in(tmp_path / "elsewhere" / "runs" / "x", result)
    assert not (ROOT / "runs" / "x").exists()


@pytest.mark.integration
def test_sim_from_a_wheel_install(tmp_path):
    """The wheel holds every module the daemons import; they run from it, started in the user's folder."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    packages = ("common", "flcore", "participant", "agent", "broker_server", "models", "security", "protocol", "sim",
                "region", "provisioning", "skyfed")
    for package in packages:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(source)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    (wheel,) = (tmp_path / "wheels").glob("skyfed-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    shutil.rmtree(source)  # nothing of the source is left to import from
    (tmp_path / "user").mkdir()
    code = "import skyfed, sim.run, agent.training_child; print(skyfed.__file__, sim.run.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "user", env=env, capture_output=True,
                           text=True, check=True).stdout.split()  # fmt: skip
    assert all(Path(f).is_relative_to(site) for f in found), found
    result = run_skyfed(["sim", *SHORT, "--out", "out"], tmp_path / "user", str(site))
    assert_results_in(tmp_path / "user" / "out", result)


def test_the_daemons_import_what_this_process_runs():
    """The source root joins PYTHONPATH only when nothing else than the start folder puts it on the path."""
    root = str(SOURCE_ROOT)
    assert child_pythonpath("", ["/somewhere", "/usr/lib/python3"]) == root
    assert child_pythonpath("/x", [root, "/usr/lib/python3"]) == os.pathsep.join([root, "/x"])
    assert child_pythonpath("/x", ["/somewhere", root]) == "/x"  # an install or PYTHONPATH: nothing to add
