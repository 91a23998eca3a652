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


def task_of(name: str) -> str:
    """``classify`` or ``detect``: which trainer and evaluator model ``name`` needs; the operator's own model
    (``package.module:function``, ``models.own``) is a classifier."""
    if ":" in name:
        return "classify"
    if name in YOLO_YAMLS:
        return "detect"
    if name in CLASSIFIERS:
        return "classify"
    raise ValueError(f"model {name!r} is unknown; choose one of {sorted([*CLASSIFIERS, *YOLO_YAMLS])} or your own "
                     '"package.module:function" (docs/own-model.md)')
