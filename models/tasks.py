"""What a SkyFed model is for (``classify`` or ``detect``) and the tag its ONNX files carry.

Torch-free on purpose: the agent daemon (which keeps PyTorch in its training child) and the on-device
inference (``agent.infer``) decide by model name without importing PyTorch.
"""

TASKS = ("classify", "detect")
ONNX_FORMAT = "skyfed-onnx/1"  # metadata "format" of every ONNX file models.onnx_export writes
CLASSIFIERS = ("fedavg_cnn", "digits_cnn", "mlp_digits", "mlp_mnist", "mnist1d_cnn",  # built by models.zoo
               "thesis_mlp_digits", "thesis_cnn_digits", "thesis_mlp_mnist1d", "thesis_cnn_mnist1d")  # seed 004
PARTS = ("full", "backbone", "head")  # what of a detector is averaged (server.share); the rest stays local
YOLO_YAMLS = {name: f"{name}.yaml" for name in ("yolov8n", "yolov8s", "yolo11n", "yolo11s")}  # Ultralytics' own


MODEL_FILES = (".yaml", ".yml", ".pt")  # an operator's own detector: Ultralytics architecture or checkpoint


def is_model_file(name: str) -> bool:
    """Whether ``name`` is the operator's own detector, named by its file: an Ultralytics model ``.yaml`` or a
    ``.pt`` checkpoint at an absolute path, the same on the server and every agent (docs/own-model.md)."""
    return name.startswith("/") and name.endswith(MODEL_FILES)


def task_of(name: str) -> str:
    """``classify`` or ``detect``: which trainer and evaluator model ``name`` needs; the operator's own model
    (``package.module:function``, ``models.own``) is a classifier, an Ultralytics ``.yaml``/``.pt`` file a
    detector."""
    if is_model_file(name):
        return "detect"
    if ":" in name:
        return "classify"
    if name in YOLO_YAMLS:
        return "detect"
    if name in CLASSIFIERS:
        return "classify"
    raise ValueError(f"model {name!r} is unknown; choose one of {sorted([*CLASSIFIERS, *YOLO_YAMLS])} or your own "
                     '"package.module:function", or a detector\'s absolute .yaml/.pt path (docs/own-model.md)')
