"""The models the server keeps beside the global one, for strategies that keep them (model swapping, seed
004; group models, seed 000).

After a round, an agent's model is its start model plus its (clipped) delta, computed with
``models.weights.advanced`` exactly as the agent computes it, so both sides name it by the same
``fingerprint``. The ``ModelBank`` keeps each such model as one float32 safetensors file,
``<state_dir>/checkpoint/agents/r<round>/<agent>.safetensors``, written (fsync, atomic rename) before
the checkpoint that refers to it and read back memory-mapped. An ``Assignment`` says what an agent
starts its next round from: its own model (``local``: the agent has it on disk) or a model the server
seals to it (``inbox``: a swap partner's, or its own when the server clipped it, so it differs from
the agent's copy, or a model that is not the agent's: a swap partner's, its group's). Agents without an
assignment start from the global model. An assignment may also name ``Peers``: kept models the agent's
trainer attends over besides its start (FedAMN: its cluster's), sealed to it as one bundle
(``peer_bundle``: each float tensor stacked over the models, rows anonymous). The round task lists every kept
model's fingerprint beside its owner's id, so a bundle must not hold those exact bits: each is built for its
recipient from a secret ``salt`` (kept in the checkpoint, never sent), which orders its rows at random and
scales every value by a random factor within 2^-16 of 1 (``DITHER``, up to hundreds of float32 steps: far
below a training step, and no bundle holder, nor sybils pooling their bundles, can search back to a
fingerprint the task lists). The round task names a bundle by ``bundle_name``: a SHA-256 over its salt and
its rows' fingerprints (or random names: ``ModelBank.writer``), which the server has already, where hashing every
recipient's dithered bundle cost 100 agents x 10 models x 12.8 MB a round; the name travels in the sealed
(signed) bundle's metadata (``BUNDLE_NAME``), and the salt, secret, keeps it from saying anything about the rows.
The strategy's ``plan_starts`` says who gets what (``strategies.base``). Disk: one model per assignment, plus the
models of the round being closed; files nothing refers to are released at the next checkpoint, to be written over
by the next round's models (``common.spare_files``), and deleted at the one after if none took them.
"""

from __future__ import annotations

import hashlib
import mmap
import random
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from common.files import AtomicFile
from common.spare_files import SpareFiles
from models.serialization import float32_header, float32_region
from models.weights import Fingerprinter, NamedArrays, TensorSpec, unflatten

DITHER = 2.0**-16  # a bundle's values are each scaled by a factor in [1 - DITHER, 1 + DITHER]
BUNDLE_NAME = "bundle"  # the sealed bundle's metadata key for its name


@dataclass(frozen=True)
class Holding:
    """One kept model: ``owner``'s model after round ``round``, and its fingerprint; not ``fingerprinted``, a
    random name instead, for a model only ever sent in a bundle (``ModelBank.writer``)."""

    round: int
    owner: str
    sha256: str
    fingerprinted: bool = True


@dataclass(frozen=True)
class Peers:
    """Kept models an agent receives beside its start model, in bundle row order, the bundle's name
    (``bundle_name``), and the secret its rows were dithered with."""

    models: tuple[Holding, ...]
    sha256: str
    salt: str = ""


@dataclass(frozen=True)
class Assignment:
    """What one agent starts its next round from: ``source`` is ``local`` or ``inbox``; ``peers``, what
    its trainer attends over (none for most strategies)."""

    source: str
    model: Holding
    peers: Peers | None = None

    def __post_init__(self) -> None:
        if not self.model.fingerprinted:  # the task names it, and the agent trains only from what it names
            raise ValueError(f"{self.model.owner}'s model of round {self.model.round} is named at random, not "
                             "fingerprinted: it can be sent only in a bundle (ModelBank.writer), never as a start")

    def holdings(self) -> set[Holding]:
        """Every kept model this assignment needs on disk."""
        return {self.model, *(self.peers.models if self.peers is not None else ())}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Assignment:
        peers = data.get("peers")
        return cls(source=data["source"], model=Holding(**data["model"]),
                   peers=None if peers is None else Peers(tuple(Holding(**h) for h in peers["models"]),
                                                          peers["sha256"], peers.get("salt", "")))  # fmt: skip


def peer_bundle(vectors: list[np.ndarray], spec: tuple[TensorSpec, ...], salt: str = "") -> NamedArrays:
    """The bundle of ``Peers``: every float tensor of ``spec`` as one (models, *shape) float32 array, each
    value dithered by a factor drawn from ``salt`` (none without)."""
    rng = np.random.default_rng(int(salt, 16)) if salt else None
    rows = [unflatten(v if rng is None else dithered(v, rng), spec) for v in vectors]
    return {s.name: np.stack([row[s.name] for row in rows]) for s in spec}


def bundle_name(models: tuple[Holding, ...], salt: str, spec: tuple[TensorSpec, ...]) -> str:
    """What a round task calls the bundle of ``models`` (in row order) dithered with ``salt``."""
    digest = hashlib.sha256(f"skyfed-peers\0{salt}\0{[(s.name, s.shape) for s in spec]}".encode())
    for holding in models:
        digest.update(f"{holding.sha256}\0".encode())
    return digest.hexdigest()


def dithered(vector: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``vector`` with each value scaled by its own factor, uniform in [1 - DITHER, 1 + DITHER] (float32)."""
    factors = rng.random(vector.size, dtype=np.float32)
    factors *= np.float32(2 * DITHER)
    factors += np.float32(1 - DITHER)
    return np.multiply(vector, factors, dtype=np.float32)


def settle(
    current: dict[str, Assignment], asked: list[str], kept: dict[str, Holding], planned: dict[str, Assignment] | None
) -> dict[str, Assignment]:
    """Where every agent starts after a round, given what the strategy ``planned`` (``None``: everyone from
    the global model) for a committed round, or, for a round rolled back, ``kept = {}`` and ``planned = {}``.

    An agent ``asked`` to train whose model was not ``kept`` (refused, late, excused, or the round rolled
    back) may have replaced its own copy by training anyway, so the model the server holds for it is sent
    to its inbox (with the models it attends over, if any); other agents the plan does not name keep their
    assignment."""
    if planned is None:
        return {}
    out = dict(current)
    for agent in asked:
        if agent not in kept and agent in out:
            out[agent] = replace(out[agent], source="inbox")
    out.update(planned)
    return out


class ModelWriter:
    """A model kept front to back as its float32 values are computed (``write``, in ``flatten`` order): written
    to the bank and fingerprinted on the way (or named at random: ``ModelBank.writer``), so it is never read back
    to be named; ``close`` makes it durable."""

    def __init__(
        self, file: AtomicFile, fingerprinter: Fingerprinter, round_number: int, owner: str, fingerprinted: bool
    ) -> None:
        self._file, self._fingerprinter = file, fingerprinter
        self.round, self.owner, self.fingerprinted = round_number, owner, fingerprinted

    def write(self, values: np.ndarray) -> None:
        for held in self._fingerprinter.update(values):
            self._file.write(held)

    def close(self) -> Holding:
        """The model, fsynced and in place (``AtomicFile.commit``); discarded if its values fell short."""
        try:
            holding = Holding(self.round, self.owner, self._fingerprinter.hexdigest(), self.fingerprinted)
        except ValueError:
            self._file.discard()
            raise
        self._file.commit()
        return holding

    def discard(self) -> None:
        self._file.discard()

    def keep(self, vector: np.ndarray) -> Holding:
        """The whole model at once: written and closed, or discarded if that fails."""
        try:
            self.write(vector)
        except BaseException:
            self.discard()
            raise
        return self.close()


class KeepWriter(Protocol):
    def __call__(self, name: str, *, fingerprinted: bool = True) -> ModelWriter: ...


class RandomName:
    """A ``Digest`` that hashes nothing and names its model by 256 random bits (``ModelBank.writer``)."""

    def __init__(self) -> None:
        self._name = secrets.token_hex(32)

    def update(self, data: bytes | np.ndarray, /) -> None:
        pass

    def hexdigest(self) -> str:
        return self._name


class ModelBank:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.spares = SpareFiles(directory)

    def path(self, holding: Holding) -> Path:
        return self._path(holding.round, holding.owner)

    def _path(self, round_number: int, owner: str) -> Path:
        return self.directory / f"r{round_number}" / f"{owner}.safetensors"

    def writer(
        self,
        round_number: int,
        owner: str,
        spec: tuple[TensorSpec, ...],
        arrays: Mapping[str, np.ndarray],
        *,
        fingerprinted: bool = True,
    ) -> ModelWriter:
        """``owner``'s model after round ``round_number``, kept as its floats are computed (``ModelWriter``);
        ``arrays``: the model's other entries, which its fingerprint covers and the bank does not keep.

        Not ``fingerprinted``: a model that only ever leaves the server as a row of a dithered bundle (FedAMP's
        cloud models beside each agent's own), whose bits no one receives and so no one checks against a
        fingerprint, is named by 256 random bits instead (``RandomName``), unique as a fingerprint is: its
        SHA-256 would buy nothing (1.0 CPU-s a round for 100 cloud models of 3.2M values)."""
        file = AtomicFile(self._path(round_number, owner), 0o600, self.spares.take(), write_behind=True)
        try:
            file.write(float32_header(spec))
            digest = hashlib.sha256 if fingerprinted else RandomName
            return ModelWriter(file, Fingerprinter(arrays, spec, digest), round_number, owner, fingerprinted)
        except BaseException:
            file.discard()
            raise

    def new_models(
        self, round_number: int, spec: tuple[TensorSpec, ...], arrays: Mapping[str, np.ndarray]
    ) -> KeepWriter:
        """A strategy's new models of round ``round_number`` (a group's, a cloud model), each a ``writer`` whose
        owner is "+name", never an agent id."""

        def writer(name: str, *, fingerprinted: bool = True) -> ModelWriter:
            return self.writer(round_number, f"+{name}", spec, arrays, fingerprinted=fingerprinted)

        return writer

    def vector(self, holding: Holding) -> np.ndarray:
        """The kept model's float vector (global model layout), a read-only view of its file: good until a
        commit no longer names the model (its file is then released, to be written over)."""
        with open(self.path(holding), "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return float32_region(mapped)[0]

    def peers(self, models: tuple[Holding, ...], spec: tuple[TensorSpec, ...]) -> Peers:
        """``models`` as one recipient's bundle: in a secret random order, dithered with a fresh secret, named
        (``bundle_name``) without building it: it is built when it is sent."""
        rows, salt = tuple(random.SystemRandom().sample(models, len(models))), secrets.token_hex(16)
        return Peers(rows, bundle_name(rows, salt, spec), salt)

    def bundle(self, peers: Peers, spec: tuple[TensorSpec, ...]) -> NamedArrays:
        """The bundle as its recipient gets it; ``BUNDLE_NAME`` in the metadata it is sent with names it."""
        return peer_bundle([self.vector(h) for h in peers.models], spec, peers.salt)

    def keep_only(self, holdings: set[Holding]) -> None:
        """Release every kept model but ``holdings`` to the spares (``common.spare_files``) and delete rounds'
        folders left empty."""
        wanted = {self.path(h) for h in holdings}
        folders = [f for f in self.directory.iterdir() if f != self.spares.directory]
        self.spares.release([p for f in folders if f.is_dir() for p in f.iterdir() if p not in wanted])
        for folder in folders:
            if not folder.is_dir():
                folder.unlink(missing_ok=True)
            elif not any(folder.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)
