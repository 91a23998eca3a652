"""Datasets: scikit-learn's bundled digits (offline) and the agents' on-disk format.

An agent's data is one ``.npz`` file (or a folder holding ``data.npz``) with two arrays:
``x`` — images ``(N, C, H, W)`` or ``(N, H, W)`` (single channel), or 1-D signals ``(N, L)`` (single
channel, read as ``(N, 1, L)``), uint8 (scaled by 1/255) or float — and ``y`` — integer class labels
``(N,)``. It is read with ``allow_pickle=False``. An agent's local test split is a second such file.
"""

from __future__ import annotations

import importlib.metadata
import io
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from models.classify_data import ClassifyData
from models.dataset import Dataset
from models.dataset_cache import cached_split

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """scikit-learn's 1,797 8x8 digits (shipped in the wheel), scaled to [0, 1], stratified split; kept in the
    dataset cache (``models.dataset_cache``), so only the first run imports scikit-learn."""
    version = importlib.metadata.version("scikit-learn")
    return cached_split(f"digits-sklearn{version}-test{test_fraction!r}-seed{seed}",
                        lambda: _split_digits(test_fraction, seed), _digits_fit)  # fmt: skip


def _digits_fit(train: Dataset, test: Dataset) -> bool:
    """What ``_split_digits`` makes: 1,797 8x8 images in [0, 1], labels 0-9."""
    return all(d.x.shape[1:] == (1, 8, 8) and d.x.min(initial=0) >= 0 and d.x.max(initial=0) <= 1
               and d.y.max(initial=0) <= 9 for d in (train, test)) and len(train) + len(test) == 1797  # fmt: skip


def _split_digits(test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    # reshape, not [:, None]: a new axis has stride 0 and the split's copy then strides it like channels-last, which
    # PyTorch's convolutions follow, so a fresh split trained unlike the same split read back from the cache
    x = (bunch.images / 16.0).astype(np.float32).reshape(-1, 1, *bunch.images.shape[1:])
    y = bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return Dataset(x_train, y_train), Dataset(x_test, y_test)


DIGITS = ClassifyData(
    "digits", "digits_cnn", (1, 8, 8), lambda seed: load_digits(test_fraction=0.2, seed=seed),
    "scikit-learn's bundled 8x8 digits (nothing is downloaded): 20 % held out for the server's evaluation",
)  # fmt: skip


def save_npz(path: Path, data: Dataset) -> None:
    """Write the agent data format (float32 ``x``, int64 ``y``), atomically; single-channel signals
    ``(N, 1, L)`` as ``(N, L)``, which ``load_npz`` reads back as they were."""
    if data.x.ndim == 3 and data.x.shape[1] != 1:
        raise ValueError(f"signals of {data.x.shape[1]} channels have no .npz form here; x must be (N, 1, L)")
    buffer = io.BytesIO()
    np.savez(buffer, x=data.x[:, 0] if data.x.ndim == 3 else data.x, y=data.y)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)


def load_npz(path: Path) -> Dataset:
    """Read the agent data format; errors name the file and what is expected."""
    expected = "expected arrays x (N,C,H,W), (N,H,W) or (N,L) and y (N,)"
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [k for k in ("x", "y") if k not in archive.files]
            if missing:
                raise ValueError(f"data file {path} has no array {missing[0]!r}; {expected}")
            x, y = archive["x"], archive["y"]
    except (OSError, ValueError) as exc:
        if str(path) in str(exc):
            raise
        raise ValueError(f"data file {path} cannot be read as .npz ({exc}); {expected}") from None
    if x.ndim in (2, 3):  # single-channel signals (N, L) or images (N, H, W)
        x = x[:, None]
    x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"data file {path}: y must hold integer labels, got {y.dtype}; {expected}")
    try:
        return Dataset(x, y.astype(np.int64))
    except ValueError as exc:
        raise ValueError(f"data file {path}: {exc}") from None


def load_dataset(path: Path) -> Dataset:
    """``path`` is an ``.npz`` file or a folder containing ``data.npz``."""
    return load_npz(path / "data.npz" if path.is_dir() else path)


def to_loader(data: Dataset, *, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(seed)
    tensors = TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y))
    return DataLoader(tensors, batch_size=batch_size, shuffle=shuffle, generator=generator)
