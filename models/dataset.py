"""``Dataset``, samples and labels checked on construction: below both the loaders that make one
(``models.datasets``, ``models.mnist1d``) and the registry that declares what each dataset loads
(``models.classify_data``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Dataset:
    """Samples ``x`` (float32) and labels ``y`` (int64) of equal length."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0] or self.y.ndim != 1:
            raise ValueError(f"x has {self.x.shape[0]} samples but y has shape {self.y.shape}; need y of shape (N,)")
        if self.x.dtype != np.float32 or self.y.dtype != np.int64:
            raise ValueError(f"x must be float32 and y int64, got {self.x.dtype} and {self.y.dtype}")
        if not np.isfinite(self.x).all():
            raise ValueError("x contains NaN or Inf")
        if self.y.size and self.y.min() < 0:
            raise ValueError("labels in y must be >= 0")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, indices: np.ndarray) -> Dataset:
        return Dataset(self.x[indices], self.y[indices])
