"""Datasets derived the same way every time, kept in the user's cache so that later runs skip the work.

scikit-learn's digits split costs every ``skyfed sim`` layout about 0.8 s of CPU, nearly all of it importing
scikit-learn (and SciPy with it): the split itself takes milliseconds. A cached split is one ``.npz`` file
named by everything that decides its content (the loader's parameters, the library's version, ``FORMAT``),
written atomically and read without pickle; a file that cannot be read, or holds arrays that do not fit what
the loader makes, is made again and replaced. The folder is ``SKYFED_CACHE_DIR``, else
``$XDG_CACHE_HOME/skyfed``, else ``~/.cache/skyfed``. A cache that cannot be written costs only the time.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from common.files import atomic_write
from models.dataset import Dataset

FORMAT = 1  # raise it when a cached loader's output changes for the same name
log = logging.getLogger("skyfed.data")


def cache_dir() -> Path:
    if folder := os.environ.get("SKYFED_CACHE_DIR"):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skyfed"


def cached_split(
    name: str, make: Callable[[], tuple[Dataset, Dataset]], fits: Callable[[Dataset, Dataset], bool]
) -> tuple[Dataset, Dataset]:
    """``make()``'s (train, test) split, from the cache file ``name`` when it holds one that ``fits`` (the shapes
    and labels the loader makes), else made and kept."""
    try:
        path = cache_dir() / f"{name}.v{FORMAT}.npz"
    except RuntimeError as exc:  # no home folder to find a cache in
        log.info("no dataset cache (%s): the split is made each run", exc)
        return make()
    try:
        with np.load(path, allow_pickle=False) as archive:
            cached = Dataset(archive["x_train"], archive["y_train"]), Dataset(archive["x_test"], archive["y_test"])
        if fits(*cached):
            return cached
        log.warning("cached dataset %s does not fit its loader: made again", path)
    except FileNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, the loader can make the split again
        log.warning("cached dataset %s unreadable (%s: %s): made again", path, type(exc).__name__, exc)
    train, test = make()
    buffer = io.BytesIO()
    np.savez(buffer, x_train=train.x, y_train=train.y, x_test=test.x, y_test=test.y)
    try:
        atomic_write(path, buffer.getbuffer(), mode=0o600)
    except OSError as exc:
        log.info("dataset cache %s not written (%s): the next run makes it again", path, exc)
    return train, test
