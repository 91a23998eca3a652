"""Feature skew: every agent's inputs seen through its own transformation, beside any label skew.

Feature (domain) skew is the non-IID kind where clients share a label space but not an input distribution
(Kairouz et al. 2021, arXiv:1912.04977, §3.1 "feature distribution skew"); seed 003 builds it from MNIST
variants (rotation, noise and image backgrounds), rotated MNIST being the usual benchmark. Here each agent
gets one transformation of four parts, drawn once from ``(seed, agent)``:

- ``rotate`` (degrees): an angle drawn from [−rotate, rotate]. An 8x8 image is rotated by it (bilinear,
  zeros outside); a 1-D signal (MNIST-1D) is turned like a phase, circularly shifted by angle/360 of its
  length, rounded to whole samples.
- ``scale``: a gain drawn from [1 − scale, 1 + scale], multiplying every value (intensity or amplitude).
- ``offset``: a constant drawn from [−offset, offset], added to every value.
- ``noise``: a Gaussian noise std drawn from [0, noise], fresh noise on every sample.

``offset`` and ``noise`` are in units of the pool's standard deviation (0.38 for digits in [0, 1], 1.0 for
MNIST-1D), so a spec means as much on one dataset as on the other. ``0`` turns a part off. Pure numpy
(SciPy for the image rotation): arrays in, arrays out.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from models.dataset import Dataset

NAME = "feature-skew"
_PARAMETERS, _NOISE = 0, 1  # random streams under (seed, agent): the transformation, then each split's noise


@dataclass(frozen=True)
class FeatureSkew:
    """The ranges every agent's transformation is drawn from (``feature-skew:rotate=…,scale=…``)."""

    rotate: float = 30.0
    scale: float = 0.2
    offset: float = 0.2
    noise: float = 0.1

    def __post_init__(self) -> None:
        limits = {"rotate": (0.0, 180.0, True), "scale": (0.0, 1.0, False)}
        for key in ("rotate", "scale", "offset", "noise"):
            value = getattr(self, key)
            low, high, closed = limits.get(key, (0.0, np.inf, False))
            if not (np.isfinite(value) and low <= value and (value <= high if closed else value < high)):
                raise ValueError(f"{NAME} option {key}={value:g} is out of range; use {OPTIONS}")

    @classmethod
    def parse(cls, options: str) -> FeatureSkew:
        """``""`` (the defaults) or ``"rotate=30,noise=0.1"``: each key at most once, every other key refused."""
        known = {f.name for f in fields(cls)}
        values: dict[str, float] = {}
        for item in options.split(",") if options else []:
            key, sep, text = item.partition("=")
            key = key.strip()
            if key not in known:
                raise ValueError(f"{NAME} option {key!r} is unknown; use {OPTIONS}, e.g. {NAME}:rotate=45,noise=0.1")
            if not sep or key in values:
                raise ValueError(f"{NAME} option {key!r} needs one value, as {key}=NUMBER; use {OPTIONS}")
            try:
                values[key] = float(text)
            except ValueError:
                raise ValueError(f"{NAME} option {key}={text!r} is not a number; use {OPTIONS}") from None
        return cls(**values)


_FORMS = {"rotate": "DEGREES in [0, 180]", "scale": "S in [0, 1)", "offset": "O >= 0", "noise": "N >= 0"}
OPTIONS = ", ".join(f"{key}={form} (default {getattr(FeatureSkew(), key):g})" for key, form in _FORMS.items())


@dataclass(frozen=True)
class Transform:
    """One agent's transformation: x ↦ gain · rotate(x, angle) + shift + N(0, noise²)."""

    angle: float  # degrees
    gain: float
    shift: float  # in the data's units
    noise: float  # std, in the data's units

    def describe(self) -> str:
        return f"rotated {self.angle:+.1f} deg, gain {self.gain:.2f}, offset {self.shift:+.2f}, noise {self.noise:.2f}"


def draw(skew: FeatureSkew, seed: int, agent: int, unit: float = 1.0) -> Transform:
    """Agent number ``agent``'s transformation under ``seed``: the same on every machine and every run, and
    independent of how many agents there are. ``unit``: the data's standard deviation (offset and noise)."""
    rng = np.random.default_rng([seed, agent, _PARAMETERS])
    angle, gain, shift, noise = rng.uniform([-1.0, -1.0, -1.0, 0.0], 1.0)
    return Transform(angle * skew.rotate, 1 + gain * skew.scale, shift * skew.offset * unit, noise * skew.noise * unit)


def apply(x: np.ndarray, transform: Transform, rng: np.random.Generator) -> np.ndarray:
    """``transform`` on samples ``x``: images (N, C, H, W) or single-channel signals (N, 1, L); float32 out."""
    turned = _rotate(np.asarray(x, np.float32), transform.angle)
    noise = rng.normal(0.0, transform.noise, turned.shape) if transform.noise else 0.0
    return (transform.gain * turned + transform.shift + noise).astype(np.float32)


def _rotate(x: np.ndarray, angle: float) -> np.ndarray:
    if x.ndim == 4:
        from scipy.ndimage import rotate

        return rotate(x, angle, axes=(2, 3), reshape=False, order=1, mode="constant", cval=0.0) if angle else x
    if x.ndim == 3:
        return np.roll(x, round(angle / 360 * x.shape[-1]), axis=-1)
    raise ValueError(f"{NAME} transforms images (N, C, H, W) or signals (N, 1, L), got x of shape {x.shape}")


def deal(labels: np.ndarray, n_agents: int, seed: int) -> np.ndarray:
    """The owner (0 … n_agents − 1) of each sample: equal shares with the same label mix (sorted by label
    after a seeded shuffle, then dealt in turn), e.g. the server's evaluation set cut into one part per domain."""
    order = np.random.default_rng([seed, n_agents]).permutation(len(labels))
    order = order[np.argsort(labels[order], kind="stable")]
    owner = np.empty(len(labels), np.int64)
    owner[order] = np.arange(len(labels)) % n_agents
    return owner


def transformed(
    data: Dataset, owner: np.ndarray, spec: FeatureSkew, seed: int, unit: float, stream: int = 0
) -> Dataset:
    """``data`` with sample i under the transformation of agent ``owner[i]`` (noise from ``stream``, so two sets
    of one agent, e.g. its share and its part of the evaluation set, draw different noise)."""
    x = np.empty(data.x.shape, np.float32)
    for agent in np.unique(owner):
        rows = np.flatnonzero(owner == agent)
        rng = np.random.default_rng([seed, int(agent), _NOISE, stream])
        x[rows] = apply(data.x[rows], draw(spec, seed, int(agent), unit), rng)
    return Dataset(x, data.y)
