"""``training.device``: which processor an agent trains on — ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

An agent told to train on a GPU it does not have must say so when it starts, not at its first round.
The daemon holds no PyTorch (its training child does), so it asks a short child of the same interpreter
how many CUDA devices PyTorch sees (``check_device_present``); the training child and simulation hosts
resolve the setting with PyTorch itself (``torch_device``). Both give the same message (``device_problem``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_FORMS = '"auto", "cpu", "cuda" or "cuda:N" (N = the GPU\'s index)'
PROBE_TIMEOUT_S = 120.0  # importing PyTorch on a slow board takes tens of seconds
PROBE = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def check_device_spec(spec: str) -> None:
    """Raise ``ValueError`` naming the key unless ``spec`` is one of ``DEVICE_FORMS``."""
    if spec not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d{1,3}", spec):
        raise ValueError(f"training.device must be {DEVICE_FORMS}, got {spec!r}")


def device_problem(spec: str, cuda_devices: int) -> str:
    """Why ``spec`` cannot be used where PyTorch sees ``cuda_devices`` GPUs (``""`` when it can)."""
    if not spec.startswith("cuda"):
        return ""
    index = int(spec.partition(":")[2] or 0)
    if cuda_devices == 0:
        return (f'training.device = "{spec}" but PyTorch sees no CUDA GPU on this machine (no NVIDIA driver, or a '
                'CPU-only PyTorch build); set training.device = "auto" or "cpu"')  # fmt: skip
    if index >= cuda_devices:
        return (f'training.device = "{spec}" but PyTorch sees {cuda_devices} CUDA GPU(s), cuda:0 to '
                f'cuda:{cuda_devices - 1} (CUDA_VISIBLE_DEVICES renumbers them); pick one of those')  # fmt: skip
    return ""


def cuda_device_count() -> int:
    """How many CUDA devices PyTorch sees, asked of a child process (this one stays free of PyTorch)."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=True)  # fmt: skip
        return int(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0  # PyTorch cannot even start: no GPU training either way


def check_device_present(spec: str) -> None:
    """At an agent's start: raise ``ValueError`` when ``spec`` names a CUDA device this machine lacks."""
    if spec.startswith("cuda") and (problem := device_problem(spec, cuda_device_count())):
        raise ValueError(problem)


def torch_device(spec: str) -> torch.device:
    """``spec`` as a ``torch.device`` (``auto``: the first GPU when there is one, else the CPU), or a
    ``ValueError`` saying why this machine cannot train there."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        return torch.device("cuda" if count else "cpu")
    if problem := device_problem(spec, count):
        raise ValueError(problem)
    return torch.device(spec)
