"""Ultralytics YOLO detectors as SkyFed models: built offline from their ``.yaml``, split into backbone and head.

Ultralytics reads its settings from the environment once, at import; ``ultralytics_offline`` sets them
first (``YOLO_OFFLINE`` skips the DNS probe, ``YOLO_AUTOINSTALL=false`` forbids run-time ``pip install``,
``YOLO_CONFIG_DIR`` keeps settings.json under SkyFed's state dir, ``YOLO_VERBOSE=False`` keeps progress
bars out of journald). ``prepare_run`` also closes what those leave open (``offline_run_settings``): a
training or validation run would otherwise look up Arial.ttf on GitHub every time, and integration
callbacks (analytics, Ultralytics Platform, experiment trackers) could send data. Nothing here ever
names a hub checkpoint: a ``.pt`` is only read from a path the operator gives (``load_pt_weights``), and
only for the weights whose names and shapes match. Ultralytics' AMP check, which loads a hub checkpoint,
never runs: SkyFed trains with ``amp=False`` and does mixed precision itself (``participant.amp``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from common.files import atomic_write
from models.tasks import PARTS, YOLO_YAMLS, is_model_file
from models.yolo_dataset import DetectionData, resolved_yaml

# Ultralytics settings that reach the network: analytics sync, Platform streaming, experiment trackers
OFFLINE_SETTINGS = {"sync": False, "api_key": "", "clearml": False, "comet": False, "dvc": False, "mlflow": False,
                    "raytune": False, "tensorboard": False, "wandb": False}  # fmt: skip
FONTS = ("Arial.ttf", "Arial.Unicode.ttf")  # what Ultralytics' dataset check downloads unless they are there


def ultralytics_offline(config_dir: Path | None = None) -> None:
    """Settings for a machine without internet; call before the first ``import ultralytics`` (later calls
    change nothing, as Ultralytics reads them once). Values already in the environment win; an Ultralytics
    API key is removed."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_AUTOINSTALL", "false")
    os.environ.setdefault("YOLO_VERBOSE", "False")
    os.environ.pop("ULTRALYTICS_API_KEY", None)  # a key would stream every run to Ultralytics Platform
    if config_dir is not None:
        config_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("YOLO_CONFIG_DIR", str(config_dir))


def prepare_run(data: DetectionData, work_dir: Path, yaml_name: str) -> Path:
    """The work dir of an Ultralytics run over ``data``: offline settings under it, and the dataset as a yaml
    with absolute paths (``resolved_yaml``), whose path is returned."""
    work_dir.mkdir(parents=True, exist_ok=True)
    ultralytics_offline(work_dir / "ultralytics")
    offline_run_settings()
    return resolved_yaml(data, work_dir / yaml_name)


def offline_run_settings() -> None:
    """``OFFLINE_SETTINGS`` in Ultralytics' settings file, and its ``FONTS`` in its config dir: its dataset
    check only needs them to exist (plots are off), so matplotlib's DejaVu Sans stands in for both."""
    from matplotlib import get_data_path
    from ultralytics.utils import SETTINGS, USER_CONFIG_DIR

    if any(SETTINGS.get(key) != value for key, value in OFFLINE_SETTINGS.items()):
        SETTINGS.update(OFFLINE_SETTINGS)
    font = Path(get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    for name in FONTS:
        if not (USER_CONFIG_DIR / name).exists():
            atomic_write(USER_CONFIG_DIR / name, font.read_bytes())


def detection_model(name: str, num_classes: int) -> nn.Module:
    """A freshly initialised Ultralytics ``DetectionModel`` of architecture ``name``: a zoo name (``yolo11n``),
    or the operator's own model file (``models.tasks.is_model_file``): a ``.yaml``, or the architecture a
    ``.pt`` checkpoint records (its weights are the server's start: ``ServerConfig.init_weights_path``)."""
    ultralytics_offline()
    from ultralytics.nn.tasks import DetectionModel

    return DetectionModel(architecture(name), nc=num_classes, verbose=False)


def architecture(name: str) -> str | dict:
    """What Ultralytics builds ``name`` from: a zoo name's bundled ``.yaml``, the operator's ``.yaml`` path, or
    the model description a ``.pt`` checkpoint carries (torch.load of a pickle: only a file the operator's own
    config names, never one a round task names: ``models.own.model_refusal``)."""
    if not is_model_file(name):
        return YOLO_YAMLS[name]
    if not name.endswith(".pt"):
        return name
    from ultralytics.nn.tasks import load_checkpoint

    model, _ = load_checkpoint(name)
    return dict(model.yaml)


def model_file_problem(path: str, key: str, num_classes: int) -> str:
    """Why the operator's own detector file ``path`` (``key``) cannot be built with ``num_classes``, or ``""``."""
    if not Path(path).is_file():
        return f"{key} = {path!r}: no such file; give the absolute path of an Ultralytics model .yaml or .pt"
    try:
        detection_model(path, num_classes)
    except Exception as exc:  # noqa: BLE001 - a bad yaml or checkpoint may raise anything inside Ultralytics
        return (f"{key} = {path!r}: Ultralytics cannot build a detector from it ({type(exc).__name__}: {exc}); "
                "give a DetectionModel .yaml (backbone and head) or a detector's .pt checkpoint")  # fmt: skip
    return ""


def part_of(name: str, model_yaml: dict) -> str:
    """``backbone`` or ``head`` for a state_dict entry ``model.<layer>.…`` of a DetectionModel: the layers the
    architecture's yaml lists under ``backbone`` come first, every later layer is the head (neck + Detect)."""
    layer = int(name.split(".")[1])
    return "backbone" if layer < len(model_yaml["backbone"]) else "head"


def shared_names(names: list[str], model_yaml: dict, part: str) -> list[str]:
    """The entries aggregation shares under ``part`` (``full``, ``backbone`` or ``head``); the rest stay local."""
    if part not in PARTS:
        raise ValueError(f"aggregate part must be one of {', '.join(PARTS)}, got {part!r}")
    return list(names) if part == "full" else [n for n in names if part_of(n, model_yaml) == part]


def load_pt_weights(model: nn.Module, path: Path) -> None:
    """Copy the weights of a local checkpoint into ``model``: an Ultralytics ``.pt`` or a SkyFed
    ``global_model.safetensors`` (an earlier run's model). Every tensor must match in name and shape (a
    partial match would silently leave layers re-initialised, the classic federated-YOLO bug)."""
    if path.suffix == ".safetensors":
        from models.serialization import load_file

        arrays, _ = load_file(path)
        theirs = {name: torch.from_numpy(array) for name, array in arrays.items()}
    else:
        ultralytics_offline()
        from ultralytics.nn.tasks import load_checkpoint

        source, _ = load_checkpoint(str(path))  # torch.load of a pickle: only ever a file the operator chose
        theirs = source.float().state_dict()
    ours = model.state_dict()
    missing = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
    if missing:
        raise ValueError(
            f"{path} does not fit this architecture/class count: {len(missing)} of {len(ours)} tensors differ "
            f"(first: {missing[0]}); give a checkpoint of the same model and number of classes"
        )
    model.load_state_dict({k: theirs[k].to(ours[k].dtype) for k in ours})
