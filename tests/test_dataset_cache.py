"""The dataset cache: a digits split read back is the split scikit-learn makes, a later run does not import
scikit-learn, and a damaged or unwritable cache costs only the time."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from models.dataset_cache import FORMAT, cache_dir
from models.datasets import _split_digits, load_digits


def same(a, b) -> bool:  # noqa: ANN001 - two (train, test) splits
    return all(np.array_equal(x.x, y.x) and np.array_equal(x.y, y.y) and x.x.dtype == y.x.dtype
               for x, y in zip(a, b, strict=True))  # fmt: skip


def test_a_cached_digits_split_is_scikit_learns_and_the_next_run_skips_scikit_learn(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYFED_CACHE_DIR", str(tmp_path))
    made = load_digits(0.2, 3)
    assert same(made, _split_digits(0.2, 3)) and len(list(tmp_path.glob(f"digits-*-test0.2-seed3.v{FORMAT}.npz"))) == 1
    assert same(load_digits(0.2, 3), made) and not same(load_digits(0.2, 4), made)
    code = "import sys; from models.datasets import load_digits; load_digits(0.2, 3); print('sklearn' in sys.modules)"
    env = {**os.environ, "SKYFED_CACHE_DIR": str(tmp_path)}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split() == ["False"]  # fmt: skip


def test_a_damaged_cache_file_is_made_again_and_an_unwritable_cache_only_costs_time(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYFED_CACHE_DIR", str(tmp_path / "cache"))
    expected = load_digits(0.2, 1)
    (cached,) = (tmp_path / "cache").iterdir()
    cached.write_bytes(cached.read_bytes()[:1000])  # truncated
    assert same(load_digits(0.2, 1), expected)
    assert same(load_digits(0.2, 1), expected) and cached.stat().st_size > 1000  # replaced by a whole file
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SKYFED_CACHE_DIR", str(blocker / "cache"))  # a folder that cannot be made
    assert same(load_digits(0.2, 1), expected) and cache_dir() == blocker / "cache"


def test_a_cache_file_that_does_not_hold_a_digits_split_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYFED_CACHE_DIR", str(tmp_path))
    expected = load_digits(0.2, 2)
    (cached,) = tmp_path.iterdir()
    np.savez(cached.with_suffix(""), x_train=np.zeros((10, 8, 8), np.float32), y_train=np.zeros(10, np.int64),
             x_test=np.zeros((5, 8, 8), np.float32), y_test=np.full(5, 99, np.int64))  # fmt: skip
    assert same(load_digits(0.2, 2), expected)
    np.save(cached.with_suffix(""), np.zeros(3))  # a plain .npy where the archive was
    cached.with_suffix(".npy").replace(cached)
    assert same(load_digits(0.2, 2), expected)
    monkeypatch.delenv("SKYFED_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME")
    monkeypatch.setattr("pathlib.Path.home", lambda: (_ for _ in ()).throw(RuntimeError("no home directory")))
    assert same(load_digits(0.2, 2), expected)
